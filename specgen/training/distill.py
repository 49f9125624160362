"""Self-distillation data: the target's own greedy answers to ShareGPT prompts, generated once.

Contract: `distilled_responses(spec)` makes sure the target has answered the first `num_prompts`
prompts of a ShareGPT split after its first `skip` (a later sitting's new prompts)
(`data.sharegpt_split`: "train" to learn from, "heldout" to measure
top-1 agreement while training) and returns the results file. The prompts are the split's first
human turns or (`turns="later"`) its later ones, each with the conversation before it as context.
The answers come from specgen's own batched engine (`job.run_job`, plain greedy decoding), so a
draft learns the distribution it will be verified against: acceptance is measured against the
target's own outputs. The file lives under `$SPECGEN_CACHE/distill/<key>/`, where the key covers
everything that changes an answer (the target's weights, dtype, answer length, prompt filter,
chat template, first or later turns) but not the number of prompts: asking for more prompts later
resumes the same file, and the three draft methods share one generation pass.

`training_sequences(path, tokenizer, ...)` turns the results back into token sequences (prompt ids
through the same chat template, then the answer ids, EOS included when the answer stopped);
`answer_token_counts` counts their answer tokens (the draft vocabulary is the most frequent).
`dataset_sequences(...)` makes the same sequences from ShareGPT's own replies to the split's first
prompts (off-policy: another model wrote them; no generation), for `train.dataset_answers`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specgen.checkpoints.store import cache_root, resolve_checkpoint
from specgen.data import PromptRecord, read_prompts, tokenize_prompt


@dataclass(frozen=True, slots=True)
class DistillSpec:
    target: str                  # the target model (alias, folder or .gguf)
    num_prompts: int
    split: str                   # "train" or "heldout" (data.sharegpt_split)
    max_new_tokens: int          # answer length cap
    max_prompt_chars: int        # longer prompts are skipped (long pastes teach little per step)
    batch_size: int
    chat_template: bool = True
    dtype: str = "auto"
    device: str = "auto"
    chat_template_kwargs: dict = field(default_factory=dict)   # e.g. {thinking: false}
    skip: int = 0                # prompts of the split passed over first (not in the key: one cache)
    turns: str = "first"         # "first" human turns, or "later" ones with the conversation so far


def target_fingerprint(folder: Path) -> str:
    """The target's identity: its config and the size and time of every weight file."""
    h = hashlib.blake2b(digest_size=8)
    h.update((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        stat = path.stat()
        h.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.hexdigest()


def distill_folder(spec: DistillSpec) -> Path:
    folder = resolve_checkpoint(spec.target)
    key = [target_fingerprint(folder), spec.split, spec.max_new_tokens, spec.max_prompt_chars,
           spec.chat_template, spec.dtype]
    if spec.chat_template_kwargs:      # only when set: caches made without them keep their key
        key.append(spec.chat_template_kwargs)
    if spec.turns != "first":          # likewise: first-turn caches keep theirs
        key.append(spec.turns)
    settings = json.dumps(key, sort_keys=True).encode()
    return cache_root() / "distill" / hashlib.blake2b(settings, digest_size=8).hexdigest()


def split_prompts(split: str, num_prompts: int, max_prompt_chars: int, skip: int = 0,
                  turns: str = "first") -> list[PromptRecord]:
    """The first `num_prompts` prompts of a split whose text (a later turn's: the whole conversation
    so far) is at most `max_prompt_chars`, after the first `skip` such prompts."""
    out: list[PromptRecord] = []
    if num_prompts <= 0:
        return out
    passed = 0
    source = f"sharegpt-{split}" if turns == "first" else f"sharegpt-{split}-later"
    for record in read_prompts(source):
        if record.error is None and sum(len(m["content"]) for m in record.messages) <= max_prompt_chars:
            if passed < skip:
                passed += 1
                continue
            out.append(record)
            if len(out) == num_prompts:
                break
    return out


def distilled_responses(spec: DistillSpec, *, on_start: Callable | None = None,
                        on_progress: Callable | None = None, on_status: Callable | None = None) -> Path:
    """The results JSONL with the target's answers to the first `num_prompts` train prompts
    (generating what is missing; resumable like any run)."""
    from specgen.job import run_job
    from specgen.recipe import recipe_from_dict

    folder = distill_folder(spec)
    folder.mkdir(parents=True, exist_ok=True)
    prompts = folder / "prompts.jsonl"
    records = split_prompts(spec.split, spec.num_prompts, spec.max_prompt_chars, spec.skip, spec.turns)
    prompts.write_text("".join(json.dumps({"id": r.id, "messages": r.messages}) + "\n" for r in records))
    results = folder / "responses.jsonl"
    recipe = recipe_from_dict({
        "target": {"model": spec.target, "dtype": spec.dtype},
        "draft": {"method": "none"},
        "sampling": {"temperature": 0.0, "seed": 0, "max_tokens": spec.max_new_tokens},
        "runtime": {"device": spec.device, "batch_size": spec.batch_size,
                    "max_seq_len": spec.max_prompt_chars // 2 + spec.max_new_tokens + 64},
        "prompts": str(prompts), "output": str(results), "chat_template": spec.chat_template,
        "chat_template_kwargs": spec.chat_template_kwargs,
    })
    run_job(recipe, on_start=on_start, on_progress=on_progress, on_status=on_status)
    return results


def training_sequences(results: Path, prompts: Path, tokenizer, chat_template: bool,
                       max_len: int, template_kwargs: dict | None = None) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) per answered prompt, in prompt order, cut to `max_len` tokens."""
    answers = {}
    with results.open() as f:
        for line in f:
            record = json.loads(line)
            if record.get("error") is None and record["token_ids"]:
                answers[record["id"]] = record["token_ids"]
    out = []
    with prompts.open() as f:
        for line in f:
            data = json.loads(line)
            if data["id"] not in answers:
                continue
            ids = tokenize_prompt(PromptRecord(id=data["id"], line=0, messages=data["messages"]),
                                  tokenizer, chat_template, template_kwargs)
            sequence = (ids + answers[data["id"]])[:max_len]
            if len(ids) < len(sequence) - 1:        # at least two answer tokens to learn from
                out.append((sequence, len(ids)))
    return out


def dataset_sequences(split: str, count: int, max_prompt_chars: int, tokenizer, chat_template: bool,
                      answer_tokens: int, max_len: int, template_kwargs: dict | None = None,
                      skip: int = 0) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) for the dataset's own replies to the first `count` prompts of a
    split (those `split_prompts` gives; the few without a reply give none), answers cut at `answer_tokens`
    (EOS only when the reply ends within them, as a generated answer), sequences at `max_len`."""
    eos = getattr(tokenizer, "eos_token_id", None)
    out = []
    for record in split_prompts(split, count, max_prompt_chars, skip):
        if record.reply is None:
            continue
        ids = tokenize_prompt(record, tokenizer, chat_template, template_kwargs)
        answer = tokenizer.encode(record.reply, add_special_tokens=False)
        answer = answer[:answer_tokens] if len(answer) >= answer_tokens or eos is None else answer + [eos]
        sequence = (ids + answer)[:max_len]
        if len(ids) < len(sequence) - 1:
            out.append((sequence, len(ids)))
    return out


def answer_token_counts(sequences: list[tuple[list[int], int]], vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: how often each token occurs in the answers of (ids, prompt length) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, prompt in sequences:
        counts += torch.bincount(torch.tensor(ids[prompt:], dtype=torch.long), minlength=vocab_size)
    return counts
