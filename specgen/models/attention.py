"""Cached attention for our models: the KV cache, the per-forward attention batch, and `attend`.

Contract:
- `KVCache` is the `Cache` of models/protocol.py for multi-head / GQA attention: one
  `[slots, kv_heads, max_len, head_dim]` key and value tensor per layer.
- `AttentionBatch` describes one forward for every attention layer in it: query positions
  `[B, T]`, the cache rows (None = rows 0..B-1, the step's case), and how keys are found:
  * kernel path (CUDA): the Triton kernel reads each row up to its own last position, so nothing
    else is needed and one compiled step serves every length;
  * reference path (CPU, tests): SDPA over the first `kv_len` cache positions with a causal mask
    built once per forward; `key_index` (an arange whose LENGTH is kv_len) carries that bound, so a
    compiled step can take it as a dynamic size instead of compiling once per length. A CPU step's
    row-invariant attention (compiled or eager) takes the C++ kernel of kernels/cpu_attention.py
    instead (same contract, same bound).
- `attend(q, k, v, cache, layer, batch)` writes the new K/V at their positions, then attends.
- `attend_latent(q, entry, cache, layer, batch, scale, latent_dim)` is MLA's absorbed form of it
  over a latent cache (models/mla.py): values are the first `latent_dim` values of each entry.
Nothing here synchronises with the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.kernels import attention as kernel
from specgen.kernels import cpu_attention
from specgen.kernels import latent_attention as latent_kernel


class KVCache:
    """Preallocated keys and values, one `[slots, kv_heads, max_len, head_dim]` tensor per layer.

    Entries at positions >= a slot's committed length are scratch: a step may write them and the next
    step overwrites them, so rejected drafts never need an undo. One tensor per layer (not one stacked
    tensor) because torch.compile writes into a whole graph input in place, but copies a tensor
    around a write into a view of one."""

    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return self.k + self.v

    def narrow(self, slots: int) -> KVCache:
        view = KVCache.__new__(KVCache)
        view.k, view.v = [t[:slots] for t in self.k], [t[:slots] for t in self.v]
        return view

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        # rows: [B]; positions: [B, T]; k, v: [B, T, Hkv, D]
        heads = torch.arange(k.shape[2], device=k.device)
        index = (rows.view(-1, 1, 1), heads.view(1, -1, 1), positions.unsqueeze(1))
        self.k[layer].index_put_(index, k.transpose(1, 2).to(self.k[layer].dtype))
        self.v[layer].index_put_(index, v.transpose(1, 2).to(self.v[layer].dtype))

    @staticmethod
    def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(slots=True)
class AttentionBatch:
    positions: torch.Tensor          # [B, T] absolute query positions
    rows: torch.Tensor | None        # [B] cache rows; None = rows 0..B-1
    key_index: torch.Tensor          # [kv_len] arange; reference path reads kv_len positions
    mask: torch.Tensor | None        # [B, 1, T, kv_len] causal mask (reference path only)
    use_kernel: bool
    num_sms: int = 1                 # kernel path: > 1 splits the rows' keys (the step; 1: never split)
    # reference path: each query row's output independent of the other rows (the decode step, where
    # a token verified beside drafts must come out as it does alone; kernels/attention.py)
    row_invariant: bool = False

    @classmethod
    def build(cls, positions: torch.Tensor, rows: torch.Tensor | None, key_index: torch.Tensor,
              use_kernel: bool, num_sms: int = 1, row_invariant: bool = False) -> AttentionBatch:
        mask = None if use_kernel else kernel.causal_mask(positions, key_index)
        return cls(positions, rows, key_index, mask, use_kernel, num_sms, row_invariant)

    def at(self, positions: torch.Tensor) -> AttentionBatch:
        """The same rows and key bound at other positions (a draft's chained passes)."""
        mask = None if self.use_kernel else kernel.causal_mask(positions, self.key_index)
        return AttentionBatch(positions, self.rows, self.key_index, mask, self.use_kernel, self.num_sms,
                              self.row_invariant)

    def cache_rows(self, batch: int, device) -> torch.Tensor:
        return self.rows if self.rows is not None else torch.arange(batch, device=device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
           batch: AttentionBatch, scale: float | None = None) -> torch.Tensor:
    # q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] -> [B, T, Hq, D]
    rows = batch.cache_rows(q.shape[0], q.device)
    cache.write(layer, rows, batch.positions, k, v)
    if not batch.use_kernel:
        if (batch.row_invariant and batch.rows is None
                and cpu_attention.supports(q, cache.k[layer], cache.v[layer])):
            # a CPU step, compiled or eager: the C++ kernel keeps the reference's row invariance
            # (and more: nor does the key bound change a row's sums), and reads each key once for
            # all the rows of its KV head (kernels/cpu_attention.py)
            return torch.ops.specgen.cpu_decode_attention(
                q, cache.k[layer], cache.v[layer], batch.positions, batch.key_index,
                scale if scale is not None else q.shape[-1] ** -0.5)
        return kernel.attention_reference(q, cache.k[layer], cache.v[layer], batch.rows, batch.mask,
                                          scale, batch.row_invariant)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    splits = kernel_splits(batch, cache.max_len)
    return kernel.cached_attention(q, cache.k[layer], cache.v[layer], rows, batch.positions.contiguous(),
                                   scale, splits)


def kernel_splits(batch: AttentionBatch, max_len: int) -> int:
    """Programs each row's keys are split over on the kernel path: several only on the step (decode,
    whose few queries would leave the device's SMs idle; a prefill has programs enough), as many as the
    cache's length gives (kernels/attention.py: `choose_splits`), never what the batch happens to be."""
    if batch.num_sms <= 1:
        return 1
    return kernel.choose_splits(max_len)


def attend_latent(q: torch.Tensor, entry: torch.Tensor, cache, layer: int, batch: AttentionBatch,
                  scale: float, latent_dim: int) -> torch.Tensor:
    # q: [B, T, H, R + P]; entry: [B, T, 1, R + P] -> [B, T, H, R]
    if not batch.use_kernel:   # the one-head cache whose keys and values are the same entries
        return attend(q, entry, entry, cache, layer, batch, scale)[..., :latent_dim]
    rows = batch.cache_rows(q.shape[0], q.device)
    cache.write(layer, rows, batch.positions, entry)
    splits = kernel_splits(batch, cache.max_len)
    return latent_kernel.latent_attention(q, cache.k[layer], rows, batch.positions.contiguous(), scale,
                                          latent_dim, splits)
