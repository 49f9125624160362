"""Target features for draft training, captured on the fly, and the padded batches they come from.

On the fly by default: a draft reads 1-5 layers of the target's hidden states at every position
(SmolLM2: 1.2 KB per layer and token in bf16, so 1 M training tokens are 1.2 GB per layer on disk).
Where the target's forward dominates a step (a CPU, a reduced draft vocabulary) and the data is
trained on for several epochs or methods, `train.feature_cache` keeps them on disk instead
(training/feature_cache.py). The target runs frozen, in the training dtype, without gradients.

`padded_batch(sequences)` right-pads token sequences into a `[B, T]` batch with the mask of the
positions a draft should learn to predict (inside the answer, past its first token: that one is
always the target's own). Padding sits after every real token, so causal attention never reads it.
"""

from __future__ import annotations

import torch

from specgen.models.attention import AttentionBatch


def padded_batch(sequences: list[tuple[list[int], int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, prompt length) pairs -> tokens [B, T] and scored [B, T] (bool)."""
    length = max(len(ids) for ids, _ in sequences)
    tokens = torch.full((len(sequences), length), pad, dtype=torch.long)
    scored = torch.zeros(len(sequences), length, dtype=torch.bool)
    for row, (ids, prompt) in enumerate(sequences):
        tokens[row, :len(ids)] = torch.tensor(ids)
        scored[row, prompt + 1:len(ids)] = True
    return tokens, scored


@torch.no_grad()
def target_features(target, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
    """tokens: [B, T] -> the hidden states leaving `layers` (output ids), concatenated: [B, T, n * H]."""
    batch, length = tokens.shape
    positions = torch.arange(length, device=tokens.device).expand(batch, length)
    cache = target.new_cache(batch, length, target.input_embedding.dtype, tokens.device)
    attn = AttentionBatch.build(positions, None, torch.arange(length, device=tokens.device), use_kernel=False)
    _, aux = target(tokens, positions, cache, attn, capture=layers)
    return aux
