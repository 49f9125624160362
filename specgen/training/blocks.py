"""DFlash training: many `[anchor, MASK x K]` blocks per sequence, under the inference attention mask.

For a block anchored at position a (the anchor token is the sequence's token at a, as at inference
it is the last committed token), the draft sees the fused target context at positions < a and its
own block (drafts/dflash.py `block_masks`, the very function inference uses), and block index i
(1..K) predicts the token at a + i. Every block of a sequence is one row of the draft's batch with
the sequence's context keys, so one pass trains `anchors` blocks per sequence (z-lab/dflash and
SpecForge sample random anchors the same way). The loss of index i is weighted by
exp(-(i - 1) / gamma): early positions decide the acceptance length.
"""

from __future__ import annotations

import math

import torch

from specgen.drafts.dflash import block_masks
from specgen.models.layers import rope_cos_sin
from specgen.training.soft_labels import label_loss


def sample_anchors(scored: torch.Tensor, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchor positions [B, count] and which are real [B, count]: a is an anchor candidate when the
    token at a + 1 is scored (a is inside the answer, so at inference it would be a committed token)."""
    batch, length = scored.shape
    candidates = torch.zeros_like(scored, device="cpu")
    candidates[:, :-1] = scored[:, 1:].cpu()
    anchors = torch.zeros(batch, count, dtype=torch.long)
    keep = torch.zeros(batch, count, dtype=torch.bool)
    for b in range(batch):
        where = candidates[b].nonzero().flatten()
        if where.numel() == 0:
            continue
        take = min(count, where.numel())
        pick = torch.randperm(where.numel(), generator=generator)[:take]
        anchors[b, :take] = where[pick].sort().values
        keep[b, :take] = True
    return anchors.to(scored.device), keep.to(scored.device)


def block_logits(draft, aux: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """aux: [B, S, n * H]; tokens: [B, S]; anchors: [B, N] -> logits [B, N, K, Vd] (float32) over
    the draft vocabulary (`draft.block_head` maps them to the target's at inference)."""
    batch, length = tokens.shape
    count = anchors.shape[1]
    k = draft.num_speculative_tokens
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    ctx = draft.context(aux)                                                   # [B, S, H]
    cos_c, sin_c = rope_cos_sin(positions, draft.inv_freq, ctx.dtype)
    block_pos = (anchors.unsqueeze(-1) + torch.arange(k + 1, device=tokens.device)).view(-1, k + 1)
    x = draft.embed_block(tokens.gather(1, anchors).view(-1, 1))              # [B * N, K + 1, H]
    cos_b, sin_b = rope_cos_sin(block_pos, draft.inv_freq, x.dtype)
    masks = block_masks(draft.config, block_pos, torch.arange(length, device=tokens.device))
    for i, layer in enumerate(draft.layers):
        keys, values = layer.self_attn.context_kv(ctx, cos_c, sin_c)           # [B, S, Hkv, D]
        keys = keys.transpose(1, 2).repeat_interleave(count, 0)                # [B * N, Hkv, S, D]
        values = values.transpose(1, 2).repeat_interleave(count, 0)
        x = layer(x, cos_b, sin_b, keys, values, masks[i])
    return draft.draft_logits(x[:, 1:]).view(batch, count, k, -1)


def block_loss(draft, aux: torch.Tensor, tokens: torch.Tensor, scored: torch.Tensor, anchors: torch.Tensor,
               keep: torch.Tensor, gamma: float, label_map: torch.Tensor | None = None,
               teacher: torch.Tensor | None = None,
               soft_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Position-decayed cross-entropy over every kept block; returns (loss, correct [K], count [K]).
    `label_map` [V]: target id -> draft id (-1 outside the draft vocabulary: such labels are left out
    of the loss, as they can never be drafted, and count as misses in the agreement). `teacher`
    [B, S, Vd]: the target's distribution of the token after each position
    (training/soft_labels.py), mixed into the loss with `soft_weight`."""
    batch, length = tokens.shape
    k = draft.num_speculative_tokens
    offsets = torch.arange(1, k + 1, device=tokens.device)
    where = anchors.unsqueeze(-1) + offsets                                   # [B, N, K]
    inside = where < length
    where = where.clamp(max=length - 1)
    labels = tokens.unsqueeze(1).expand(-1, anchors.shape[1], -1).gather(2, where)
    valid = keep.unsqueeze(-1) & inside & scored.unsqueeze(1).expand(-1, anchors.shape[1], -1).gather(2, where)
    scored_labels = valid                 # agreement counts a label outside the vocabulary as a miss
    if label_map is not None:
        labels = label_map[labels]
        valid = valid & (labels >= 0)
    logits = block_logits(draft, aux, tokens, anchors)                        # [B, N, K, Vd]
    weights = torch.exp(-(offsets - 1).float() / gamma) if gamma > 0 else torch.ones(k, device=tokens.device)
    probs = None
    if teacher is not None:     # the label at a + i is what the target predicted at a + i - 1
        rows = torch.arange(batch, device=tokens.device).view(-1, 1, 1).expand_as(where)
        probs = teacher[rows[valid], where[valid] - 1]                          # [M, Vd]
    ce = label_loss(logits[valid], labels[valid], probs, soft_weight)
    w = weights.expand_as(valid)[valid]
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    right = (logits.argmax(-1) == labels) & valid
    return loss, right.sum((0, 1)), scored_labels.sum((0, 1))


def default_gamma(block_size: int) -> float:
    """Decay constant of the position weights when the recipe gives none (half the block, >= 1)."""
    return max(1.0, math.floor(block_size / 2))
