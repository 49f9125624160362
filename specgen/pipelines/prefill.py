"""Host-side planning of batched prefill: which prompts go together, padded how, in which chunks.

Contract: `plan_prefill(items, chunk=, budget=, alone=)` takes the prompts admitted into free slots and
returns the calls to make, in order. Prompts are sorted by length and grouped so that one call pads
little (rows of similar length: padding is at most a quarter of a call's tokens) and holds at most
`budget` padded tokens; a prompt longer than `chunk` tokens is split into chunks (at positions 0,
chunk, 2 chunk, ...), and chunk r of every prompt of a group goes into the group's r-th call.
With `alone` every prompt is a group of its own: its calls, their shapes and so every bit they
compute (its cache entries, its first token's logits) depend on the prompt alone, never on which
prompts were admitted beside it, when, or how long they are. The runner asks for that on CPU, where
a GEMM's row, and SDPA's, comes out with other bits in a call of other shapes (kernels/cpu_linear.py)
and which prompts share an admission follows the slots' finishing order: speculative and plain
jobs, or one job at two batch sizes, would prefill a prompt differently. A group buys a CPU little
(a call of one prompt's rows is already compute-bound); on CUDA calls are grouped.
All calls of one admission run back to back, before the next step: a slot whose prompt is only half
written is inactive, and an inactive slot's step writes scratch at its first positions.

`pack(call, alloc_len, key_index, device)` turns one call into a `PrefillBatch` with ONE host->device copy (a
pinned buffer on CUDA, so the copy never waits for the step in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.pipelines.unified import PrefillBatch

PAD_MULTIPLE = 16   # padded lengths are multiples of this: few distinct shapes


@dataclass(slots=True)
class PrefillItem:
    slot: int
    prompt: list[int]
    noise_key: int
    limit: int          # the slot stops once its committed length reaches this (state.limit)
    reasoning: bool = False   # the prompt leaves the output inside a reasoning span (state.reasoning)


@dataclass(slots=True)
class PrefillCall:
    items: list[PrefillItem]
    start: int          # first prompt position of this chunk
    chunk: int          # prompt tokens per chunk
    width: int          # padded length T of this call (>= its longest piece)


def _padded(n: int) -> int:
    return -(-n // PAD_MULTIPLE) * PAD_MULTIPLE


def plan_prefill(items: list[PrefillItem], *, chunk: int, budget: int,
                 max_padding: float = 0.25, alone: bool = False) -> list[PrefillCall]:
    """Calls for `items`: groups of similar length (the padding that grouping adds is at most
    `max_padding` of a call's tokens) of at most `budget` padded tokens, in chunks of `chunk`;
    `alone`: a group per prompt."""
    assert chunk % PAD_MULTIPLE == 0, f"the prefill chunk must be a multiple of {PAD_MULTIPLE}"
    if alone:
        return [call for item in items for call in _chunked([item], chunk)]
    calls: list[PrefillCall] = []
    group: list[PrefillItem] = []
    own = 0           # the group's tokens, each row padded to its own width: what grouping cannot save
    for item in sorted(items, key=lambda i: len(i.prompt)):
        width = _padded(min(len(item.prompt), chunk))
        padded = (len(group) + 1) * width
        if group and (padded > budget or padded - own - width > max_padding * padded):
            calls.extend(_chunked(group, chunk))
            group, own = [], 0
        group.append(item)
        own += width
    if group:
        calls.extend(_chunked(group, chunk))
    return calls


def _chunked(group: list[PrefillItem], chunk: int) -> list[PrefillCall]:
    calls, start = [], 0
    while True:
        rows = [i for i in group if len(i.prompt) > start]
        if not rows:
            return calls
        longest = max(min(len(i.prompt) - start, chunk) for i in rows)
        calls.append(PrefillCall(rows, start, chunk, _padded(longest)))
        start += chunk


def pack(call: PrefillCall, alloc_len: int, key_index: torch.Tensor, device: torch.device) -> PrefillBatch:
    """One call as device tensors. Padding tokens sit at positions past their prompt (scratch)."""
    n, width, start = len(call.items), call.width, call.start
    tokens = torch.zeros(n, width, dtype=torch.long)
    following = torch.zeros(n, width, dtype=torch.long)
    per_row = torch.zeros(6, n, dtype=torch.long)  # slot, last_index, is_last, noise_key, limit, reasoning
    for r, item in enumerate(call.items):
        real = min(len(item.prompt) - start, call.chunk)
        piece = item.prompt[start: start + real]
        after = item.prompt[start + 1: start + real + 1]   # a mid-prompt chunk: its next chunk's first
        tokens[r, :real] = torch.tensor(piece)
        following[r, : len(after)] = torch.tensor(after)
        ends_here = start + real >= len(item.prompt)
        per_row[:, r] = torch.tensor([item.slot, real - 1, int(ends_here), item.noise_key, item.limit,
                                      int(item.reasoning)])
    host = torch.cat((tokens.view(-1), following.view(-1), per_row.view(-1)))
    if device.type == "cuda":
        host = host.pin_memory()
    flat = host.to(device, non_blocking=True)
    tokens, following, per_row = flat.split([n * width, n * width, 6 * n])
    per_row = per_row.view(6, n)
    # positions past the allocation (padding of a prompt that nearly fills it) write its last entry
    positions = (start + torch.arange(width, device=device)).clamp(max=alloc_len - 1).expand(n, width)
    return PrefillBatch(rows=per_row[0], tokens=tokens.view(n, width), positions=positions.contiguous(),
                        next_tokens=following.view(n, width), last_index=per_row[1],
                        is_last=per_row[2].bool(), noise_key=per_row[3], limit=per_row[4],
                        reasoning=per_row[5].bool(), key_index=key_index)
