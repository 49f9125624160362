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


def read_draft_config(config_cls, config: dict, target, where: str, name: str):
    """The draft's config checked against its target; a bad one is a CheckpointError naming the file."""
    from specgen.checkpoints.store import CheckpointError

    try:
        return config_cls.from_hf(config, target_layers=target.num_layers,
                                  target_hidden=target.hidden_size, target_vocab=target.vocab_size)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}/config.json: not a usable {name} config: {err}") from err


def materialise(make: Callable[[], torch.nn.Module], state: dict[str, torch.Tensor], *, dummy: bool,
                dtype: torch.dtype, device, seed: int, where: str) -> torch.nn.Module:
    """Build a draft on the meta device and assign its checkpoint tensors, or build it on `device`
    with deterministic random weights (load_format: dummy)."""
    from specgen.checkpoints.weights import load_into, random_init

    with torch.device(device if dummy else "meta"):
        draft = make()
    if dummy:
        draft.to(dtype)
        random_init(draft, seed=seed)
    else:
        load_into(draft, state, dtype=dtype, device=device, where=where)
    return draft
