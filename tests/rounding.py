"""Telling rounding from a bug where two greedy runs that should agree do not (bf16, GPU_NOTES item 2).

In bf16 a token verified beside drafts need not get the bits a plain step gives it (a GEMM's kernel
depends on its row count), so greedy speculative and plain decoding may part where two tokens score
almost the same. `rounding_problems` checks each request's FIRST differing position (after it the two
runs continue from different text) against float32 logits of the common prefix, from transformers'
model of the checkpoint (the numeric reference): both tokens must be within `ulps` bf16 units in the
last place of the float32 argmax. A draft or cache bug picks tokens far from the top (a random token
of a tiny random model lies ~2 logits below it; rounding gaps measured 0.002-0.045 at a top of ~2.5,
i.e. at most 3 ulps).
"""

from __future__ import annotations

import math

import torch


def bf16_ulp(x: float) -> float:
    """bf16's spacing at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def first_differences(got: dict[str, list[int]], want: dict[str, list[int]]) -> dict[str, int]:
    """request id -> the first position where the two runs' tokens differ (requests that differ)."""
    out = {}
    for key, a in want.items():
        b = got[key]
        if a != b:
            out[key] = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return out


def rounding_problems(checkpoint, prompt_ids: list[list[int]], got: dict[str, list[int]],
                      want: dict[str, list[int]], ulps: float = 6.0) -> list[str]:
    """Each differing request whose first difference is not a near-tie, described; [] when none.
    Keys are `test_speculative.run`'s ids ("p0", "p1", ...: the index into `prompt_ids`)."""
    from transformers import AutoModelForCausalLM

    differing = first_differences(got, want)
    if not differing:
        return []
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    problems = []
    for key, t in differing.items():
        a, b = want[key], got[key]
        if t >= min(len(a), len(b)):
            problems.append(f"{key}: one run stopped at {t} tokens, the other went on")
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids[int(key[1:])] + a[:t]])).logits[0, -1].float()
        top = float(logits.max())
        limit = ulps * bf16_ulp(top)
        gaps = {tok: top - float(logits[tok]) for tok in (a[t], b[t])}
        if max(gaps.values()) > limit:
            problems.append(f"{key} at token {t}: {a[t]} vs {b[t]}, {gaps} below the float32 top "
                            f"{top:.3f} (near-tie limit {limit:.3f})")
    return problems
