"""Token bitmasks applied to logits inside the step (the grammar engine fills them on the host).

Layout (xgrammar's): row r is W = ceil(V / 32) int32 words; bit j of word w set = token 32 w + j
allowed. All bits set (-1) = no constraint.
"""

from __future__ import annotations

import torch


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return (vocab_size + 31) // 32


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # masks: [..., W] int32 -> [..., V] bool
    shifts = torch.arange(32, device=masks.device, dtype=torch.int32)
    bits = (masks.unsqueeze(-1) >> shifts) & 1                       # arithmetic shift: sign bit too
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_token_masks(logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    # logits: [..., V]; masks: [..., W] int32 -> logits with disallowed tokens at -inf
    return logits.masked_fill(~allowed_tokens(masks, logits.shape[-1]), float("-inf"))
