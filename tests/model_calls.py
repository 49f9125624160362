"""Calling our models directly in tests: the attention batch of the reference path, and logits."""

from __future__ import annotations

import torch

from specgen.models.attention import AttentionBatch


def attn(positions: torch.Tensor, kv_len: int, rows: torch.Tensor | None = None,
         use_kernel: bool = False) -> AttentionBatch:
    return AttentionBatch.build(positions, rows, torch.arange(kv_len, device=positions.device), use_kernel)


def logits(model, tokens, positions, cache, kv_len, rows=None, capture=()):
    """(float32 logits [B, T, V], captured features) of a target forward."""
    hidden, aux = model(tokens, positions, cache, attn(positions, kv_len, rows), capture=capture)
    return model.logits(hidden), aux


def propose(draft, aux, next_tokens, positions, last_index, cache, kv_len, pick, rows=None):
    """A draft's propose on the reference attention path (rows: cache rows, None = 0..B-1)."""
    return draft.propose(aux, next_tokens, positions, last_index, cache, attn(positions, kv_len, rows), pick)
