"""`specgen run` as a library call: a validated recipe in, results JSONL + stats JSON out.

Contract: `run_job(recipe, ...)` resolves the device and checkpoints, checks that the run fits in
memory BEFORE any weights load, skips ids already in the output (resume), streams one result line per
prompt as it finishes (errors are records, never crashes), and writes `<output>.stats.json` at the end
(also after Ctrl-C, for what finished). Raises `JobError` for problems with the run as a whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specgen.checkpoints.store import CheckpointError, read_config, resolve_checkpoint
from specgen.checkpoints.tokenizer import load_tokenizer
from specgen.data import (PromptRecord, PromptSourceError, ResultWriter, read_prompts,
                          stats_path, tokenize_prompt, write_json_atomic)
from specgen.drafts.mtp import has_mtp_layer
from specgen.models.layers import KVCache
from specgen.models.loading import architecture_name, load_target, target_config
from specgen.pipelines.registry import check_pairing, draft_kind
from specgen.pipelines.runner import Completion, Progress, Request, Runner, RunTotals
from specgen.pipelines.stops import StopRules, eos_ids_from
from specgen.pipelines.unified import UnifiedStep
from specgen.recipe import Recipe
from specgen.sampling import SamplingTensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class JobError(Exception):
    """The run as a whole cannot start (memory, checkpoint, prompt source); nothing was lost."""


@dataclass(slots=True)
class JobSummary:
    output: Path
    stats_file: Path
    stats: dict
    skipped: int
    notes: list[str]


@dataclass(slots=True)
class Resolved:
    device: torch.device
    dtype: torch.dtype
    target_folder: Path | None
    target_config: dict
    draft_folder: Path | None
    draft_config: dict | None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise JobError("recipe.runtime.device: cuda was asked for but no CUDA device is available")
    return torch.device(name)


def resolve(recipe: Recipe) -> Resolved:
    device = resolve_device(recipe.runtime.device)
    dtype_name = recipe.target.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    dummy = recipe.target.load_format == "dummy"
    try:
        folder = resolve_checkpoint(recipe.target.model, needs_weights=not dummy)
        config = read_config(folder)
        target_config(config, str(folder / "config.json"))  # fails early on a config we can't read
        draft_folder = draft_cfg = None
        if recipe.draft.enabled:
            check_pairing(architecture_name(config), recipe.draft.method)
            if recipe.draft.load_format != "dummy":
                draft_folder, draft_cfg = _draft_checkpoint(recipe, folder, config)
    except (CheckpointError, ValueError) as err:
        raise JobError(str(err)) from err
    return Resolved(device, DTYPES[dtype_name], folder, config, draft_folder, draft_cfg)


def _draft_checkpoint(recipe: Recipe, target_folder: Path, target_config: dict) -> tuple[Path, dict]:
    if recipe.draft.model is not None:
        folder = resolve_checkpoint(recipe.draft.model)
        return folder, read_config(folder)
    # Only methods whose layer can live in the target's checkpoint get here (recipe.DRAFT_IN_TARGET).
    if not has_mtp_layer(target_folder, target_config):
        raise CheckpointError(f"{target_folder}: draft.method {recipe.draft.method} without draft.model needs "
                              f"MTP layers in the target checkpoint (model.layers."
                              f"{target_config.get('num_hidden_layers')}.*), and there are none")
    return target_folder, target_config


# ------------------------------------------------------------------------------------------- memory


def estimate_bytes(recipe: Recipe, r: Resolved) -> dict[str, int]:
    """What the run will hold, from configs alone: weights, KV caches, per-step logits workspace."""
    cfg = target_config(r.target_config)
    item = torch.empty((), dtype=r.dtype).element_size()
    b, k, dcfg = recipe.runtime.batch_size, 0, None
    if recipe.draft.enabled:
        _, dummy_config, config_cls = draft_kind(recipe.draft.method)
        dcfg = config_cls.from_hf(r.draft_config or dummy_config_for(cfg, dummy_config),
                                  target_layers=cfg.num_layers, target_hidden=cfg.hidden_size,
                                  target_vocab=cfg.vocab_size)
        # A DFlash draft without an explicit K drafts a whole block.
        k = recipe.draft.num_speculative_tokens or getattr(dcfg, "block_size", 2) - 1
    seq = recipe.runtime.max_seq_len + 2 * k + 2
    kv = KVCache.bytes_needed(cfg.num_layers, b, cfg.num_kv_heads, seq, cfg.head_dim, r.dtype)
    parts = {"target weights": cfg.num_parameters() * item, "target KV cache": kv,
             "logits workspace": 4 * b * (k + 1) * cfg.vocab_size * 4}
    if dcfg is not None:
        parts["draft weights"] = dcfg.num_parameters() * item
        layers = getattr(dcfg, "num_layers", 1)
        parts["draft KV cache"] = KVCache.bytes_needed(layers, b, dcfg.num_kv_heads, seq, dcfg.head_dim,
                                                       r.dtype)
        if recipe.draft.stochastic:
            parts["draft probabilities"] = b * k * cfg.vocab_size * 4
    return parts


def dummy_config_for(cfg, dummy_config) -> dict:
    class _Shape:  # the dummy-config builders read `target.config`
        config = cfg
    return dummy_config(_Shape)


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def check_memory(recipe: Recipe, r: Resolved) -> dict[str, int]:
    parts = estimate_bytes(recipe, r)
    need, have = sum(parts.values()), available_bytes(r.device)
    if need > 0.9 * have:
        gib = 1 << 30
        detail = ", ".join(f"{name} {size / gib:.2f} GiB" for name, size in parts.items())
        where = "free device memory" if r.device.type == "cuda" else "available RAM"
        raise JobError(
            f"this run needs about {need / gib:.2f} GiB ({detail}) but only {have / gib:.2f} GiB of "
            f"{where} is there. Lower runtime.batch_size (now {recipe.runtime.batch_size}) or "
            f"runtime.max_seq_len (now {recipe.runtime.max_seq_len}), or use a smaller target.dtype.")
    return parts


# ---------------------------------------------------------------------------------------------- run


def request_key(request_id: str) -> int:
    """A request's noise stream comes from its id, so a resumed run reproduces it."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


def build_runner(recipe: Recipe, r: Resolved, seed: int):
    """Load the models and bind them into a Runner; returns (runner, tokenizer, notes)."""
    notes: list[str] = []
    dummy_target = recipe.target.load_format == "dummy"
    target = load_target(r.target_config, r.target_folder, dtype=r.dtype, device=r.device,
                         dummy=dummy_target)
    if dummy_target:
        notes.append("target.load_format is dummy: random weights, the output text is meaningless "
                     "(for measuring speed only)")
    tokenizer = load_tokenizer(r.target_folder, target.vocab_size)
    draft = None
    if recipe.draft.enabled:
        loader, dummy_config, _ = draft_kind(recipe.draft.method)
        dummy = recipe.draft.load_format == "dummy"
        draft = loader(r.draft_config or dummy_config(target), r.draft_folder, target,
                       num_speculative_tokens=recipe.draft.num_speculative_tokens, dtype=r.dtype,
                       device=r.device, dummy=dummy)
        if dummy:
            notes.append(f"draft.load_format is dummy: a RANDOMLY INITIALISED {recipe.draft.method} "
                         "draft (deterministic, demo only); output equals the target's alone but "
                         "acceptance is near zero")
    step = UnifiedStep(target, draft, stochastic_drafts=recipe.draft.stochastic)
    s = recipe.sampling
    b = recipe.runtime.batch_size
    sampling = SamplingTensors.build([s.temperature] * b, [s.top_k] * b, [s.top_p] * b,
                                     [s.min_p] * b, r.device)
    generation_config = {}
    if r.target_folder and (r.target_folder / "generation_config.json").is_file():
        generation_config = json.loads((r.target_folder / "generation_config.json").read_text())
    eos = eos_ids_from(tokenizer, generation_config, r.target_config)
    rules = StopRules(eos, tuple(s.stop), s.ignore_eos,
                      lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    runner = Runner(step, batch_size=b, max_seq_len=recipe.runtime.max_seq_len, rules=rules,
                    sampling=sampling, seed=seed, device=r.device, dtype=r.dtype,
                    compile=recipe.runtime.compile)
    return runner, tokenizer, notes


def _requests(records: list[PromptRecord], tokenizer, recipe: Recipe) -> Iterator[Request]:
    for record in records:
        max_tokens = record.max_tokens or recipe.sampling.max_tokens
        if record.error:
            yield Request(record.id, [], max_tokens, 0, error=record.error)
            continue
        try:
            ids = tokenize_prompt(record, tokenizer, recipe.chat_template and tokenizer.chat_template is not None)
        except Exception as err:  # a prompt the tokenizer rejects is that prompt's error only
            yield Request(record.id, [], max_tokens, 0, error=f"tokenisation failed: {err}")
            continue
        yield Request(record.id, ids, max_tokens, request_key(record.id))


def result_record(c: Completion) -> dict:
    return {
        "id": c.id, "text": c.text, "token_ids": c.token_ids, "num_prompt_tokens": c.num_prompt_tokens,
        "num_output_tokens": len(c.token_ids), "finish_reason": c.finish_reason, "error": c.error,
        "spec": c.spec.to_dict() if c.spec is not None else None,
    }


def run_job(recipe: Recipe, *, prompts: str | None = None, output: str | None = None,
            limit: int | None = None, resume: bool = True,
            on_start: Callable[[int, list[str]], None] | None = None,
            on_progress: Callable[[Progress], None] | None = None) -> JobSummary:
    """Run a recipe end to end. `on_start(total, notes)` fires once the models are loaded."""
    started = time.perf_counter()
    out_path = Path(output or recipe.output)
    try:
        records = list(read_prompts(prompts or recipe.prompts, limit=limit))
    except PromptSourceError as err:
        raise JobError(str(err)) from err
    r = resolve(recipe)
    memory = check_memory(recipe, r)
    seed = recipe.sampling.seed if recipe.sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
    with ResultWriter(out_path, resume=resume) as writer:
        todo = [rec for rec in records if rec.id not in writer.done_ids]
        skipped = len(records) - len(todo)
        runner, tokenizer, notes = build_runner(recipe, r, seed)
        if recipe.chat_template and tokenizer.chat_template is None:
            notes.append("the tokenizer has no chat template: prompts are used as plain text")
        if on_start is not None:
            on_start(len(todo), notes)

        def on_finish(c: Completion) -> None:
            writer.write(result_record(c))

        complete = False
        try:
            runner.run(_requests(todo, tokenizer, recipe), on_finish, on_progress)
            complete = True
        finally:
            # Written after Ctrl-C too: the figures then cover the requests that finished.
            stats = _stats(recipe, r, seed, runner.totals, complete, memory, notes,
                           time.perf_counter() - started)
            write_json_atomic(stats_path(out_path), stats)
    return JobSummary(out_path, stats_path(out_path), stats, skipped, notes)


def _stats(recipe: Recipe, r: Resolved, seed: int, totals: RunTotals, complete: bool,
           memory: dict[str, int], notes: list[str], wall: float) -> dict:
    import transformers

    return {
        "complete": complete,
        "requests": totals.requests,
        "errors": totals.errors,
        "output_tokens": totals.output_tokens,
        "steps": totals.steps,
        "generation_seconds": totals.wall_seconds,
        "wall_seconds": wall,
        "output_tokens_per_second": totals.tokens_per_second,
        "spec": totals.spec.to_dict(),
        "seed": seed,
        "recipe": recipe.to_dict(),
        "notes": notes,
        "memory_estimate_bytes": memory,
        "device": _device_name(r.device),
        "dtype": str(r.dtype).removeprefix("torch."),
        "versions": {"specgen": _version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specgen")
    except PackageNotFoundError:
        return "unknown"
