"""`specgen train-draft` as a library call: a recipe with a `train` section in, a draft checkpoint out.

Contract: `train_draft(recipe)` runs the whole job and writes `draft.model` (a folder in the layout
`specgen run` and other engines load, with a README.md card):
1. data: the target answers train-split ShareGPT prompts (and a few held-out ones) with specgen's own
   engine, cached and shared by every draft method (training/distill.py);
2. training: AdamW, linear warm-up then cosine decay, gradient clipping, target features captured on
   the fly (training/features.py), the method's objective (training/methods.py), on the target's
   greedy tokens or, with `train.soft_labels`, its distribution too (training/soft_labels.py);
   The draft starts from random weights, or from a trained draft of the same method
   (`train.init_from`: its weights and shape; its vocabulary too where the head holds only those
   rows, EAGLE-3's, while DFlash and MTP choose theirs again from this run's answers unless
   `train.keep_vocabulary` keeps it; the card counts what both runs saw), so training can go on
   over several sittings with new data;
3. checkpoints under `$SPECGEN_CACHE/train/<key>/` every `checkpoint_every` steps and on Ctrl-C: the
   same command resumes where it stopped (the key covers the recipe's train section, the method, the
   target and the output folder; `restart=True` starts over);
4. export in the published layout, then the held-out acceptance measured with the real engine at
   each `eval_ks` (training/evaluate.py), and the card.
Progress goes to `on_progress(TrainProgress)`; one-line phases to `on_status`.
Raises `TrainError` for problems with the job as a whole.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specgen.checkpoints.loading import load_target, read_draft_tensors
from specgen.checkpoints.store import CheckpointError, cache_root
from specgen.checkpoints.tokenizer import load_tokenizer
from specgen.drafts.dflash import dflash_value
from specgen.machine import choose_threads, cpu_description, cpu_has_bf16
from specgen.recipe import Recipe
from specgen.training.distill import (DistillSpec, answer_token_counts, dataset_sequences, distill_folder,
                                      distilled_responses, target_fingerprint, training_sequences)
from specgen.training.evaluate import KResult, heldout_agreement, measure_acceptance
from specgen.training.export import write_card, write_checkpoint
from specgen.training.feature_cache import FeatureStore
from specgen.training.features import padded_batch, target_features
from specgen.training.methods import TRAINERS, mask_candidates, rechosen_vocabulary
from specgen.training.soft_labels import teacher_layer, teacher_probs


class TrainError(Exception):
    """The training job as a whole cannot run (data, target, output folder)."""


@dataclass(slots=True)
class TrainProgress:
    step: int
    total_steps: int
    loss: float
    tokens_per_second: float
    learning_rate: float
    agreement: list[float] | None       # held-out top-1 agreement per drafted position (last eval)


@dataclass(slots=True)
class TrainSummary:
    output: Path
    steps: int
    tokens_seen: int
    train_seconds: float
    agreement: list[float]
    acceptance: list[KResult] = field(default_factory=list)
    resumed_from: int = 0
    # train.eval_prompt_sets: path -> (prompts measured, acceptance per K)
    other_acceptance: dict[str, tuple[int, list[KResult]]] = field(default_factory=dict)


def train_dtype(spec, device: torch.device) -> torch.dtype:
    name = spec.dtype
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" or cpu_has_bf16() else "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def learning_rate(spec, step: int, total: int) -> float:
    """Linear warm-up to `learning_rate`, then cosine decay to `learning_rate * min_lr_ratio`."""
    if step < spec.warmup_steps:
        return spec.learning_rate * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, total - spec.warmup_steps)
    floor = spec.min_lr_ratio
    return spec.learning_rate * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_order(sizes: list[int], batch_size: int, epochs: float, seed: int) -> list[list[int]]:
    """Sequence indices per optimizer step: each epoch a seeded shuffle, cut into windows of 16
    batches that are sorted by length (less padding), the batches then shuffled again."""
    order: list[list[int]] = []
    total = math.ceil(len(sizes) * epochs / batch_size)
    epoch = 0
    while len(order) < total:
        g = torch.Generator().manual_seed(seed * 7919 + epoch)
        perm = torch.randperm(len(sizes), generator=g).tolist()
        window = 16 * batch_size
        batches = []
        for start in range(0, len(perm), window):
            chunk = sorted(perm[start:start + window], key=lambda i: sizes[i])
            batches += [chunk[j:j + batch_size] for j in range(0, len(chunk), batch_size)]
        shuffle = torch.randperm(len(batches), generator=g).tolist()
        order += [batches[i] for i in shuffle]
        epoch += 1
    return order[:total]


def _check_target_fit(spec, shape) -> None:
    """The train fields that name rows or layers of the target, against it."""
    if spec.mask_token_id is not None and spec.mask_token_id >= shape.vocab_size:
        raise TrainError(f"recipe.train.mask_token_id: {spec.mask_token_id} is not a row of the target "
                         f"embedding (vocab_size {shape.vocab_size})")
    if spec.feature_layers is not None and spec.feature_layers > shape.num_layers:
        raise TrainError(f"recipe.train.feature_layers: {spec.feature_layers} exceeds the target's "
                         f"{shape.num_layers} layers")


def _check_eval_sets(spec) -> None:
    """The card's extra prompt sets are read only at the end: a bad one fails before the hours."""
    from specgen.data import PromptSourceError, read_prompts

    for i, path in enumerate(spec.eval_prompt_sets):
        if not Path(path).is_file():
            raise TrainError(f"recipe.train.eval_prompt_sets[{i}]: {path}: no such file")
        try:
            usable = [r for r in read_prompts(path, limit=spec.eval_prompts) if r.error is None]
        except PromptSourceError as err:
            raise TrainError(f"recipe.train.eval_prompt_sets[{i}]: {err}") from err
        if not usable:
            raise TrainError(f"recipe.train.eval_prompt_sets[{i}]: {path}: no usable prompt in its first "
                             f"{spec.eval_prompts} lines")


# The train fields that shape a draft: a warm start keeps its draft's, so the recipe must agree (the
# vocabulary's size only where the method keeps the vocabulary: MethodTrainer.head_rows_chosen).
# Each reads the field's value off a draft's config.json (None: the config does not say).
def _draft_vocab(config: dict):
    return config.get("draft_vocab_size", config.get("vocab_size"))   # none given: the full vocabulary


_SHAPE_FIELDS = {
    "eagle3": {"draft_vocab_size": _draft_vocab},
    "mtp": {"draft_vocab_size": _draft_vocab},
    "dflash": {"draft_vocab_size": _draft_vocab,
               "block_size": lambda c: dflash_value(c, "block_size"),      # as the DFlash loader reads it
               "layers": lambda c: c.get("num_hidden_layers"),
               "mask_token_id": lambda c: dflash_value(c, "mask_token_id"),
               "feature_layers": lambda c: len(dflash_value(c, "target_layer_ids", ())) or None},
}


@dataclass(frozen=True, slots=True)
class WarmStart:
    folder: Path
    config: dict          # the trained draft's config.json (its shape and vocabulary win)
    lineage: dict         # what its own card says it was trained on, carried into the new card


def _warm_start(method: str, spec, folder: Path) -> WarmStart:
    """`train.init_from`, checked before any data is made: a draft of this method, in the shape the
    recipe's train fields give (a warm start keeps its draft's shape and vocabulary)."""
    from specgen.inspection.identify import draft_method_of

    where = f"recipe.train.init_from: {folder}"
    if not (folder / "config.json").is_file():
        raise TrainError(f"{where}: no config.json (not a draft checkpoint folder)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise TrainError(f"{where}/config.json: not readable JSON ({err})") from err
    config.pop("torch_dtype", None)         # written again at export, in train.export_dtype
    found = draft_method_of(config) or "mtp"
    if found != method:
        raise TrainError(f"{where}: holds an {found} draft, but draft.method is {method}")
    vocab = int(config.get("vocab_size", 0)) or None
    for field_name, read in _SHAPE_FIELDS[method].items():
        if field_name == "draft_vocab_size" and TRAINERS[method].head_rows_chosen and not spec.keep_vocabulary:
            continue                # chosen again from this run's answers (methods.rechosen_vocabulary)
        ours, theirs = getattr(spec, field_name), read(config)
        if field_name == "draft_vocab_size" and vocab:     # new drafts take min(field, vocabulary) too
            ours = min(ours, vocab)
        # None: the recipe leaves it to the default choice (mask token, feature layers), which the
        # trained draft has already made
        if ours is not None and theirs is not None and int(theirs) != ours:
            raise TrainError(f"recipe.train.{field_name}: {ours}, but the draft in train.init_from has "
                             f"{theirs} (a warm start keeps its draft's shape)")
    if not any(folder.glob("*.safetensors")):
        raise TrainError(f"{where}: no .safetensors weights")
    return WarmStart(folder, config, _lineage(folder))


def _lineage(folder: Path) -> dict:
    """What a trained draft's `training.json` says its run saw, with the totals of every run in its
    chain (nothing known where it has no card)."""
    try:
        card = json.loads((folder / "training.json").read_text())
    except (OSError, ValueError):
        card = {}
    before = card.get("init_from") or {}
    return {"folder": folder.as_posix(), "command": card.get("command"), "steps": card.get("steps"),
            "tokens_seen": card.get("tokens_seen"), "train_answers": card.get("train_answers"),
            "tokens_seen_total": (card.get("tokens_seen") or 0) + (before.get("tokens_seen_total") or 0),
            "runs": 1 + (before.get("runs") or 0)}


def _draft_k(method: str, spec) -> int:
    return spec.block_size - 1 if method == "dflash" else spec.ttt_steps


# train fields added after runs were keyed, with the value that keeps an older run's key
_LATER_FIELDS = {"init_from": None, "skip_prompts": 0, "soft_labels": 0.0, "head_init": "random",
                 "keep_vocabulary": False}


def _state_folder(recipe: Recipe, target_key: str) -> Path:
    train = {k: v for k, v in asdict(recipe.train).items() if not k.startswith("eval")}
    for name, default in _LATER_FIELDS.items():    # only when set: runs started before them keep their key
        if train[name] == default:
            del train[name]
    parts = [str(Path(recipe.draft.model).resolve()), recipe.draft.model_method, target_key, train, recipe.chat_template]
    if recipe.chat_template_kwargs:    # only when set: runs started without them keep their key
        parts.append(recipe.chat_template_kwargs)
    key = json.dumps(parts, sort_keys=True)
    return cache_root() / "train" / hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def train_draft(recipe: Recipe, *, restart: bool = False, on_status: Callable[[str], None] | None = None,
                on_progress: Callable[[TrainProgress], None] | None = None,
                on_data_progress: Callable | None = None) -> TrainSummary:
    from specgen.job import JobError, resolve

    spec, method = recipe.train, recipe.draft.model_method
    status = on_status or (lambda line: None)
    output = Path(recipe.draft.model)
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe = output / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise TrainError(f"draft.model: cannot write the trained draft to {output}: {err.strerror or err}") from err
    try:
        r = resolve(replace(recipe, draft=replace(recipe.draft, method="none")))
    except JobError as err:
        raise TrainError(str(err)) from err
    dtype = train_dtype(spec, r.device)
    dtype_name = str(dtype).removeprefix("torch.")
    # the answers' dtype is part of the data cache's key: pinned, the data is the same on every CPU
    data_dtype = dtype_name if spec.generation_dtype == "auto" else spec.generation_dtype
    # the fields naming rows or layers of the target, before hours of data generation
    _check_target_fit(spec, load_target(r.target_config, r.target_folder, dtype=dtype, device="meta",
                                        dummy=True).shape)
    _check_eval_sets(spec)
    start = _warm_start(method, spec, Path(spec.init_from)) if spec.init_from is not None else None

    # 1. data: the target's own answers (cached; shared by every draft method)
    started = time.perf_counter()

    def distill(split: str, count: int, skip: int = 0, turns: str = "first") -> tuple[Path, Path]:
        d = DistillSpec(target=recipe.target.model, num_prompts=count, split=split, skip=skip, turns=turns,
                        max_new_tokens=spec.answer_tokens, max_prompt_chars=spec.max_prompt_chars,
                        batch_size=spec.generation_batch_size, chat_template=recipe.chat_template,
                        dtype=data_dtype, device=recipe.runtime.device,
                        chat_template_kwargs=recipe.chat_template_kwargs)
        after = f" after the first {skip}" if skip else ""
        which = f"{split} prompts" if turns == "first" else f"later {split} turns"
        status(f"self-distillation data: the target's answers to {count} {which}{after} "
               f"(kept in {distill_folder(d)})")
        total = [0]

        def started_generating(count: int, header: str, notes: list[str]) -> None:
            total[0] = count
            if count:
                status(f"generating {count} answers: {header}")

        def progress(p) -> None:
            if on_data_progress is not None:
                on_data_progress(split, p, total[0])

        try:
            results = distilled_responses(d, on_start=started_generating, on_progress=progress)
        except JobError as err:
            raise TrainError(f"generating the training data: {err}") from err
        return results, results.with_name("prompts.jsonl")

    train_files = distill("train", spec.prompts, spec.skip_prompts)
    later_files = distill("train", spec.later_turns, spec.skip_later_turns, "later") if spec.later_turns else None
    heldout_files = distill("heldout", spec.heldout_prompts)
    data_seconds = time.perf_counter() - started

    # 2. target (frozen) and sequences
    threads, _ = choose_threads(recipe.runtime.threads)
    torch.set_num_threads(threads)
    target = load_target(r.target_config, r.target_folder, dtype=dtype, device=r.device, dummy=False)
    target.requires_grad_(False)
    tokenizer = load_tokenizer(r.target_folder, target.vocab_size)
    train = training_sequences(*train_files, tokenizer, recipe.chat_template, spec.max_seq_len,
                               recipe.chat_template_kwargs)
    first_turns = len(train)
    if later_files is not None:
        train += training_sequences(*later_files, tokenizer, recipe.chat_template, spec.max_seq_len,
                                    recipe.chat_template_kwargs)
    heldout = training_sequences(*heldout_files, tokenizer, recipe.chat_template, spec.max_seq_len,
                                 recipe.chat_template_kwargs)
    if not train:
        raise TrainError("the target produced no usable training answers (check train.prompts and "
                         "train.max_prompt_chars)")
    counts = answer_token_counts(train, target.vocab_size)     # the target's answers: what gets verified
    distilled = len(train)
    if round(spec.dataset_answers * distilled) > 0:
        train += dataset_sequences("train", round(spec.dataset_answers * distilled), spec.max_prompt_chars,
                                   tokenizer, recipe.chat_template, spec.answer_tokens, spec.max_seq_len,
                                   recipe.chat_template_kwargs, spec.skip_prompts)

    # 3. a fresh draft (or a trained one to start from), or the checkpoint of an interrupted run
    trainer = TRAINERS[method]
    k = _draft_k(method, spec)
    if start is not None:
        config, extra, lineage = start.config, {}, start.lineage
        try:
            initial = read_draft_tensors(method, config, start.folder, dtype=torch.float32, device=r.device)
            # A head gathered from the target's rows takes this run's most frequent answer tokens,
            # unless the run keeps the start's: its answers may be fewer than those that chose it
            # (a sitting of mostly `dataset_answers`), and a vocabulary counted on fewer answers
            # covers fewer of the tokens the target will say.
            if trainer.head_rows_chosen and not spec.keep_vocabulary:
                config, extra = rechosen_vocabulary(config, initial, target.shape, spec, counts)
            draft = trainer.build(config, extra, target, k, initial)
        except CheckpointError as err:
            raise TrainError(f"recipe.train.init_from: {err}") from err
        del initial
    else:
        unused = mask_candidates(tokenizer, target.vocab_size, [ids for ids, _ in train + heldout])
        (config, extra), lineage = trainer.new_config(target.shape, spec, counts, unused), None
        draft = trainer.build(config, extra, target, k)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=spec.weight_decay)
    order = batch_order([len(ids) for ids, _ in train], spec.batch_size, spec.epochs, spec.seed)
    state_dir = _state_folder(recipe, target_fingerprint(r.target_folder))
    checkpoint = state_dir / "checkpoint.pt"
    step, tokens_seen, train_seconds, history, agreement = 0, 0, 0.0, [], None
    if checkpoint.is_file() and not restart:
        saved = torch.load(checkpoint, weights_only=False)
        draft.load_state_dict(saved["draft"])
        optimizer.load_state_dict(saved["optimizer"])
        step, tokens_seen, train_seconds = saved["step"], saved["tokens_seen"], saved["train_seconds"]
        history, agreement = saved["history"], saved["agreement"]
        lineage = saved.get("lineage", lineage)   # as it was at the start (init_from may be the output)
        status(f"resuming from step {step} of {len(order)} ({checkpoint})")
    resumed_from = step

    def save() -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                    "tokens_seen": tokens_seen, "train_seconds": train_seconds, "history": history,
                    "agreement": agreement, "lineage": lineage}, tmp)
        os.replace(tmp, checkpoint)

    # Half-precision target features; the draft's fp32 weights run under autocast to the same dtype.
    autocast = dtype if dtype != torch.float32 else None
    soft = spec.soft_labels > 0
    layers = tuple(draft.aux_layer_ids) + ((teacher_layer(target),) if soft else ())
    store, feature_seconds = None, 0.0
    if spec.feature_cache and step < len(order):
        started = time.perf_counter()
        # the held-out sequences too: agreement is measured every eval_every steps on the same ones
        store = _filled_store(target, train + heldout, layers, r.target_folder, dtype_name, status)
        feature_seconds = time.perf_counter() - started

    def hidden_states(batch, tokens: torch.Tensor, wanted: tuple[int, ...]) -> torch.Tensor:
        # -> the outputs of the `wanted` target layers [B, T, n * H]: from the feature store, else live
        if store is not None:
            return store.read(batch, wanted, tokens.shape[1], dtype).to(r.device)
        return target_features(target, tokens, wanted)

    def cached_features(batch, tokens: torch.Tensor) -> torch.Tensor:
        return hidden_states(batch, tokens, draft.aux_layer_ids)

    def features_and_teacher(batch, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # -> the draft's features [B, T, n * H] and, with soft labels, the target's distribution
        # over the draft vocabulary [B, T, Vd] (its last layer, read in the same forward)
        captured = hidden_states(batch, tokens, layers)
        if not soft:
            return captured, None
        width = len(draft.aux_layer_ids) * target.hidden_size
        vocab = draft.draft_to_target if draft.reduced_vocab else None
        return captured[..., :width], teacher_probs(target, captured[..., width:], vocab)

    def evaluate() -> list[float]:
        draft.eval()
        try:
            return heldout_agreement(draft, target, trainer, heldout, spec, autocast=autocast,
                                     batch_size=spec.batch_size,
                                     features=cached_features if store is not None else None)
        finally:
            draft.train()

    # 4. the loop
    status(f"training {method} (K = {k}) for {len(order)} steps on {len(train)} answers, "
           f"{threads} thread{'s' * (threads != 1)}, {dtype_name}")
    draft.train()
    stop = _StopFlag()
    try:
        while step < len(order):
            if stop.raised:
                raise KeyboardInterrupt
            tick = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(spec, step, len(order))
            batch = [train[i] for i in order[step]]
            tokens, scored = (t.to(r.device) for t in padded_batch(batch))
            aux, teacher = features_and_teacher(batch, tokens)
            generator = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
            with torch.autocast(r.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss, _, _ = trainer.loss(draft, aux, tokens, scored, spec, generator, teacher)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), spec.grad_clip)
            optimizer.step()
            loss_value = float(loss.detach())
            step += 1
            real = sum(min(len(train[i][0]), tokens.shape[1]) for i in order[step - 1])
            tokens_seen += real
            elapsed = time.perf_counter() - tick
            train_seconds += elapsed
            evaluated = step % spec.eval_every == 0 or step == len(order)
            if evaluated:
                agreement = evaluate()
            history.append({"step": step, "loss": loss_value, "lr": optimizer.param_groups[0]["lr"],
                            "agreement": agreement if evaluated else None})
            if step % spec.checkpoint_every == 0:
                save()
            if on_progress is not None:
                on_progress(TrainProgress(step, len(order), loss_value, real / elapsed,
                                          optimizer.param_groups[0]["lr"], agreement))
    except KeyboardInterrupt:
        save()          # between steps: Ctrl-C only sets a flag, so no step is ever half applied
        raise
    finally:
        stop.restore()
    save()

    # 5. export, measure, card
    status(f"exporting to {output}")
    write_checkpoint(output, config, trainer.export(draft, config, extra), spec.export_dtype)
    ks = [k_ for k_ in spec.eval_ks if method != "dflash" or k_ <= spec.block_size - 1]
    if method == "dflash" and spec.block_size - 1 not in ks:
        ks.append(spec.block_size - 1)
    heldout_prompts = _first_prompts(heldout_files[1], spec.eval_prompts, state_dir / "eval-prompts.jsonl")
    recipe_data = recipe.to_dict()
    recipe_data["sampling"].update({"temperature": 0.0, "max_tokens": spec.eval_max_tokens, "stop": []})
    acceptance = measure_acceptance(recipe_data, output, ks, heldout_prompts, state_dir, on_status=status)
    others = {}
    for i, path in enumerate(spec.eval_prompt_sets):
        work = state_dir / f"eval-set-{i}"
        prompts = _first_prompts(Path(path), spec.eval_prompts, work / "prompts.jsonl")
        count = len(prompts.read_text().splitlines())
        others[path] = (count, measure_acceptance(recipe_data, output, ks, prompts, work, on_status=status,
                                                  label=Path(path).name))
    summary = TrainSummary(output, step, tokens_seen, train_seconds, agreement or [], acceptance, resumed_from,
                           others)
    write_card(output, recipe, summary, history=history, counts=counts, config=config,
               data={"train_answers": distilled, "later_turn_answers": distilled - first_turns,
                     "dataset_answers": len(train) - distilled,
                     "heldout_answers": len(heldout),
                     "data_seconds": data_seconds, "feature_seconds": feature_seconds,
                     "dtype": dtype_name, "data_dtype": data_dtype,
                     "threads": threads, "init_from": lineage,
                     "run_dtype": str(r.dtype).removeprefix("torch."),
                     "machine": _machine(r.device, threads)})
    return summary


def _filled_store(target, sequences, layers: tuple[int, ...], target_folder: Path, dtype_name: str,
                  status: Callable[[str], None]) -> FeatureStore:
    """The feature store of this target and dtype, holding `layers` of every training sequence
    (computing what it lacks: resumable, one forward per missing sequence)."""
    key = json.dumps([target_fingerprint(target_folder), dtype_name])
    folder = cache_root() / "features" / hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    store = FeatureStore(folder, target.hidden_size)
    todo = store.missing(sequences, layers)
    if todo:
        tokens = sum(len(sequences[i][0]) for i in todo)
        status(f"target features: {len(todo)} of {len(sequences)} sequences to compute, layers {list(layers)}, "
               f"{tokens * len(layers) * target.hidden_size * 2 / 1e9:.1f} GB more in {folder}")
        marks = set()

        def progress(done: int, total: int) -> None:
            tenth = 10 * done // total
            if tenth not in marks and tenth < 10:
                marks.add(tenth)
                status(f"target features: {done} of {total} sequences")

        store.fill(target, sequences, layers, batch_size=8, on_progress=progress)
    return store


class _StopFlag:
    """Ctrl-C during training sets a flag that the loop reads between optimizer steps (an interrupt
    inside `optimizer.step()` would save half-updated weights, and resume would apply that batch
    twice). A second Ctrl-C stops at once."""

    def __init__(self) -> None:
        import signal
        import threading

        self.raised = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.raised:
            raise KeyboardInterrupt
        self.raised = True

    def restore(self) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _first_prompts(prompts: Path, count: int, out: Path) -> Path:
    lines = [line for line in prompts.read_text().splitlines() if line.strip()][:count]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(line + "\n" for line in lines))
    return out


def _machine(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_description()}, {threads} thread{'s' * (threads != 1)}, {platform.system()}, no GPU"

