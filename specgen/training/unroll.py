"""Training-time test for chained drafts (EAGLE-3, MTP): the draft unrolled on its own outputs.

At inference a chained draft (drafts/chain.py) runs one pass over real target features, then K - 1
passes that feed back its own pre-norm output. Training unrolls the same chain over every position
of a sequence at once, so the draft learns from the features it will really see:

- step 0, entry t: the target feature of position t with the token at t + 1, RoPE position t,
  predicts the token at t + 2 (the first drafted token when t is the last committed position);
- step i >= 1, entry t: step i - 1's output at t with the token at t + 1 + i, RoPE position t + i,
  predicts the token at t + 2 + i (the chain's i-th pass from anchor t).

Keys, exactly as the inference cache holds them: a query of step i at entry t sees step 0's keys at
entries s <= t (the draft cache of the committed prefix, all from real features) and the keys of
steps 1..i at entry t itself (the chain's own entries at t + 1 .. t + i). `UnrolledAttention` keeps
those keys; it plugs into the draft's `pass_with` as its `Attention` (models/layers.py).

Tokens fed at step i are the sequence's own (the target's greedy answer), as SpecForge and EAGLE do:
on an accepted chain they equal the drafted ones. The loss of step i is weighted by `decay ** i`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.models.layers import CachedSelfAttention
from specgen.training.soft_labels import label_loss


class UnrolledAttention:
    """Self-attention over the unrolled steps' keys (one draft layer; a new object per sequence batch)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []      # per step: [B, Hkv, T, D]
        self.values: list[torch.Tensor] = []

    def __call__(self, module: CachedSelfAttention, x: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        # x: [B, T, in_dim] -> [B, T, hidden]
        q, k, v = module.project(x, cos, sin)
        batch, length, heads, dim = q.shape
        group = heads // k.shape[2]
        self.keys.append(k.transpose(1, 2))
        self.values.append(v.transpose(1, 2))
        q = q.transpose(1, 2) * dim ** -0.5                                   # [B, Hq, T, D]
        k0 = self.keys[0].repeat_interleave(group, 1)
        v0 = self.values[0].repeat_interleave(group, 1)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        scores = [(q @ k0.transpose(-1, -2)).masked_fill(~causal, float("-inf"))]      # [B, Hq, T, T]
        for kj in self.keys[1:]:                                              # the chain's own entries
            scores.append((q * kj.repeat_interleave(group, 1)).sum(-1, keepdim=True))  # [B, Hq, T, 1]
        probs = torch.softmax(torch.cat(scores, -1).float(), -1).to(q.dtype)
        out = probs[..., :length] @ v0
        for j, vj in enumerate(self.values[1:]):
            out = out + probs[..., length + j: length + j + 1] * vj.repeat_interleave(group, 1)
        return module.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


@dataclass(slots=True)
class StepResult:
    loss: torch.Tensor          # this step's mean cross-entropy (scalar)
    correct: torch.Tensor       # top-1 agreements (scalar count)
    count: torch.Tensor         # positions scored (scalar count)


def shifted(x: torch.Tensor, by: int, fill: int | bool) -> torch.Tensor:
    # x: [B, T] -> x[:, by:] padded at the end with `fill` (same shape)
    return torch.cat((x[:, by:], x.new_full((x.shape[0], by), fill)), 1)


def unrolled_hidden(draft, aux: torch.Tensor, tokens: torch.Tensor, steps: int):
    """Yield each unrolled step's pre-norm output [B, T, H] (entry t of step i predicts t + 2 + i).

    aux: [B, T, n * H] captured target features; tokens: [B, T]."""
    batch, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    memory = UnrolledAttention()
    feature = draft.first_feature(aux)
    for i in range(steps):
        feature = draft.pass_with(feature, shifted(tokens, 1 + i, 0), positions + i, memory)
        yield feature


def unrolled_chain(draft, aux: torch.Tensor, tokens: torch.Tensor, scored: torch.Tensor, steps: int,
                   label_map: torch.Tensor | None = None, teacher: torch.Tensor | None = None,
                   soft_weight: float = 0.0) -> list[StepResult]:
    """The per-step cross-entropy of `steps` unrolled passes of a chained draft over whole sequences.

    scored: [B, T] bool, True where the token at that position is a label worth learning (the
    answer, past its first token). `label_map` [V] maps target ids to the draft vocabulary (-1 =
    outside it; such labels are left out of the loss, as they can never be drafted, and count as
    misses in the agreement). `teacher` [B, T, Vd]: the target's distribution of the token after
    each position (training/soft_labels.py), mixed into the loss with `soft_weight`."""
    out = []
    # Entry t is an anchor at inference only once the token at t + 1 is a committed answer token,
    # i.e. when step 0's label (t + 2) is scored; later steps must not train earlier anchors.
    anchors = shifted(scored, 2, False)
    length = tokens.shape[1]
    for i, hidden in enumerate(unrolled_hidden(draft, aux, tokens, steps)):
        labels = shifted(tokens, 2 + i, 0)
        mask = shifted(scored, 2 + i, False) & anchors
        scored_labels = mask.sum()        # agreement counts a label outside the vocabulary as a miss
        if label_map is not None:
            labels = label_map[labels]
            mask = mask & (labels >= 0)
        logits = draft.draft_logits(hidden[mask])                             # [N, Vd] float32
        target = labels[mask]
        # the label at t + 2 + i is what the target predicted at t + 1 + i (mask is False past T - 2 - i)
        probs = teacher[:, 1 + i:][mask[:, :max(0, length - 1 - i)]] if teacher is not None else None
        loss = label_loss(logits, target, probs, soft_weight).mean() if target.numel() else logits.sum() * 0
        correct = (logits.argmax(-1) == target).sum()
        out.append(StepResult(loss, correct, scored_labels))
    return out
