"""The small interface every draft exposes to the unified step.

A draft is an `nn.Module` with:
- `aux_layer_ids: tuple[int, ...]`: target layer OUTPUTS it reads (DESIGN.md section 5);
- `new_cache(slots, max_len, dtype, device)`: its own static state (KV cache), or None;
- `propose(aux, next_tokens, positions, last_index, cache, kv_len, pick, slots=None)`:
  from the target features of T new positions, propose K tokens for every row. `pick` turns draft
  logits over the TARGET vocabulary into tokens (argmax, or a keyed sample plus its probabilities), so
  drafts never know about sampling settings.

Tokens and probabilities always use the target's vocabulary: a draft with a reduced vocabulary maps
its ids before returning. Nothing in `propose` may synchronise with the host.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

# pick(logits [B, V] over the target vocabulary, token positions [B]) -> (tokens [B], probs [B, V] | None)
Pick = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class Draft(Protocol):
    aux_layer_ids: tuple[int, ...]
    num_speculative_tokens: int

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device): ...

    def propose(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                last_index: torch.Tensor, cache, kv_len: int, pick: Pick,
                slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default capture: the residual entering layers 2, L//2 and L-3, named as outputs."""
    n = num_target_layers
    return (1, n // 2 - 1, n - 4)
