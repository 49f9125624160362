"""What the engine asks of a target model and of a cache: the seam between models/ and the rest.

`pipelines/` (the unified step, the runner, the memory estimate) and `drafts/` use a target ONLY
through `Target` below, never through its submodules, so a new architecture (DeepSeek-V3's MLA cache,
say) plugs in by implementing it. The contract:

- `forward(tokens [B, T], positions [B, T], cache, attn, capture=ids)` writes the cache entries of
  the T new tokens of each row at that row's positions (`attn.rows` are the cache rows; None = rows
  0..B-1) and returns the LAST layer's output `[B, T, H]` (before the final norm) and, when `capture`
  names layer outputs (id i = HF `hidden_states[i + 1]`), their concatenation `[B, T, n * H]` in the
  order given;
- `final_norm(h)`, `head(h)` (the LM head alone, float32 logits), `logits(h)` = head(final_norm(h));
  `embed(tokens)`; drafts that share the target's embedding or head call these;
- `new_cache(slots, max_len, dtype, device)` and `cache_bytes_per_token(dtype)` (for the estimate);
- `static_tensors()`: tensors outside the parameters that a CUDA graph must see at fixed addresses;
- `shape`: the dimensions drafts need to build a config in the target's shape (dummy drafts);
- `input_embedding` / `output_embedding`: the weight tensors, so loaders can share instead of copy
  (`embedding_dtype`: the embedding's dtype without building a dense table of a quantized one).

A `Cache` holds per-row state at absolute positions; entries at or past a row's committed length are
scratch (a step writes them, the next overwrites), so rejected drafts never need an undo. Its
tensors have the slot as dim 0, so a slot moves by copying rows and `narrow` views the first slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specgen.models.layers import RopeSettings


@dataclass(frozen=True, slots=True)
class TargetShape:
    """The target's dimensions, as drafts need them (dummy draft configs are built from these)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSettings


class Cache(Protocol):
    max_len: int

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the step writes, each with the slot as dim 0 (CUDA graphs keep them at
        static addresses; a slot moves by copying its row of each)."""
        ...

    def narrow(self, slots: int) -> Cache:
        """The first `slots` slots, sharing storage (a step over fewer slots)."""
        ...


class Target(Protocol):
    shape: TargetShape
    num_layers: int
    hidden_size: int
    vocab_size: int
    input_embedding: torch.Tensor
    output_embedding: torch.Tensor
    embedding_dtype: torch.dtype

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: Cache, attn: Any,
                capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def embed(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def head(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device) -> Cache: ...

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int: ...

    def static_tensors(self) -> list[torch.Tensor]: ...


def _every_tensor(name: str) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class TargetBuilder:
    """How the loader builds one architecture: config class (`from_hf`, `num_parameters`, `shape`,
    `cache_bytes_per_token`), model class, the adapter from checkpoint keys to ours, and which
    checkpoint tensors it reads at all (`reads(name)`: Kimi K2.5's vision encoder is never read).
    `shard_state(state, cfg, tp)`: a converted state cut to one tensor-parallel rank's slice, for the
    model `model_cls(cfg, tp)` builds (models/tensor_parallel.py); None where the architecture has no
    tensor-parallel layout yet."""

    config_cls: type
    model_cls: Callable[..., torch.nn.Module]
    convert_state_dict: Callable[[dict, Any], dict]
    reads: Callable[[str], bool] = _every_tensor
    shard_state: Callable[[dict, Any, Any], dict] | None = None
