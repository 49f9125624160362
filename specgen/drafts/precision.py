"""A draft that runs in another dtype than its target (a bfloat16 draft beside a float32 target).

Contract: `target_for_draft(target, dtype)` returns what a draft builder is given as its target: the
target itself when `dtype` is the target's, else a `TargetInDtype` view. The view answers everything
a draft reads of its target (sizes, `shape`, `embed`, `final_norm`, `head`, `input_embedding`,
`output_embedding`) with tensors in the draft's dtype, so the draft's code is the same in both cases.

Why it is allowed: the draft only proposes. Its precision changes how often the target agrees with
it, never what is kept: the target verifies in its own dtype, and a stochastic draft's probabilities
are computed from the very logits its token was sampled from. `draft.dtype` chooses it; `auto` takes
bf16 where bf16 GEMMs pay (AVX-512 or native bf16, job.auto_dtype), else the target's (job.draft_dtype).

What it costs: the head, when the draft shares the target's (MTP, DFlash), is held again in the
draft's dtype (vocab x hidden; SmolLM2: 57 MB in bf16), because reading the float32 one is exactly
the cost this avoids (a draft with a reduced vocabulary gathers its rows from this copy, which it
then no longer reads). The embedding is looked up in the target's dtype and converted (one row per
token, nothing to gain from a copy).
"""

from __future__ import annotations

import torch
from torch import nn

from specgen.models.layers import float32_logits
from specgen.models.quantized import QuantizedOnly


class TargetInDtype(nn.Module):
    def __init__(self, target, dtype: torch.dtype) -> None:
        super().__init__()
        self._target = (target,)              # outside the module tree: nothing of it is saved or moved
        self.dtype = dtype
        self.target_dtype = target.embedding_dtype
        try:
            head = target.output_embedding.detach().to(dtype)
        except QuantizedOnly:
            head = None     # a quantized head kept without its dense weight: this draft does not read it
        self.register_buffer("head_weight", head, persistent=False)

    # -- sizes, read by the builders -----------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self._target[0].num_layers

    @property
    def hidden_size(self) -> int:
        return self._target[0].hidden_size

    @property
    def vocab_size(self) -> int:
        return self._target[0].vocab_size

    @property
    def shape(self):
        return self._target[0].shape

    # -- the shared pieces, in the draft's dtype -----------------------------------------------------

    @property
    def input_embedding(self) -> torch.Tensor:
        return self._target[0].input_embedding.to(self.dtype)

    @property
    def output_embedding(self) -> torch.Tensor:
        return self.head_weight

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [...] -> [..., H] in the draft's dtype
        return self._target[0].embed(tokens).to(self.dtype)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> [..., H]: the target's norm, computed as the target computes it
        return self._target[0].final_norm(hidden.to(self.target_dtype)).to(self.dtype)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> [..., V] float32 logits from the head in the draft's dtype
        return float32_logits(hidden.to(self.dtype), self.head_weight)


def target_for_draft(target, dtype: torch.dtype):
    """The target as the draft builder sees it (see the module docstring)."""
    if target.input_embedding.dtype == dtype:
        return target
    return TargetInDtype(target, dtype)
