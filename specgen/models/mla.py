"""Multi-head latent attention (DeepSeek-V2/V3 MLA) over a compressed cache.

Contract:
- `LatentCache` is the `Cache` of models/protocol.py for MLA layers: per layer ONE tensor
  `[slots, 1, max_len, kv_lora_rank + qk_rope_head_dim]` holding the normed KV latent and the
  rotated shared rope key of every position; never full per-head K/V (that is what makes these
  models servable: DeepSeek-V3 caches 576 values per token and layer instead of 128 x 2 x 192).
  It exposes `k` and `v` as the same list, so `models.attention.attend` reads it as a one-head cache
  whose keys and values are the same entries; on the kernel path `attend_latent` hands it to the
  latent kernel (kernels/latent_attention.py), which loads each entry once for both.
- `LatentAttention(in_dim, hidden, dims)` is the attention module (projection names as in the
  checkpoints: `q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj`, `kv_a_proj_with_mqa`,
  `kv_a_layernorm`, `kv_b_proj`, `o_proj`). Its `forward(x, cos, sin, cache, layer, batch)` has the
  signature of layers.CachedSelfAttention, so `layers.cached` binds it the same way.

How it attends. Scores are q_nope . (W_UK c) + q_rope . k_rope and outputs W_UV (sum p c). With few
queries per row (decode and verification, T <= ABSORB_MAX_QUERIES) W_UK is absorbed into the query
and W_UV applied after the weighted sum, so attention runs directly over the cached latents as
multi-query attention with head dim kv_lora_rank + rope dims: the cache is read once and nothing
is expanded. Long chunks (prefill, reference path) expand keys and values per head from the
latents instead: there the absorbed form would cost ~3x the attention FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specgen.models.attention import AttentionBatch, attend_latent
from specgen.models.layers import RMSNorm, RopeSettings, apply_rope, apply_rope_interleaved
from specgen.models.products import Linear, project_heads

# Above this many queries per row the reference path expands K/V per head instead of absorbing.
ABSORB_MAX_QUERIES = 16
# transformers' DeepseekV3 q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class MlaDims:
    num_heads: int
    q_lora_rank: int | None          # None: a plain q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeSettings
    rope_interleave: bool = True     # DeepSeek's checkpoints store rotary dims as adjacent pairs

    @classmethod
    def from_hf(cls, config: dict) -> MlaDims:
        q_lora = config.get("q_lora_rank")
        return cls(
            num_heads=int(config["num_attention_heads"]),
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
            rope=RopeSettings.from_hf(config),
            rope_interleave=bool(config.get("rope_interleave", True)),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_scale_factor()

    def parameters(self, in_dim: int, hidden: int) -> int:
        h, q = self.num_heads, self.num_heads * self.qk_head_dim
        query = in_dim * q if self.q_lora_rank is None else (in_dim + q + 1) * self.q_lora_rank
        kv = in_dim * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * h * (
            self.qk_nope_head_dim + self.v_head_dim)
        return query + kv + h * self.v_head_dim * hidden


class LatentCache:
    """One `[slots, 1, max_len, kv_lora_rank + rope_dim]` tensor per layer; `k` and `v` are it."""

    def __init__(self, layers: int, slots: int, max_len: int, latent_dim: int, dtype: torch.dtype,
                 device) -> None:
        self.k = [torch.zeros(slots, 1, max_len, latent_dim, dtype=dtype, device=device)
                  for _ in range(layers)]
        self.v = self.k

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return list(self.k)

    def narrow(self, slots: int) -> LatentCache:
        view = LatentCache.__new__(LatentCache)
        view.k = [t[:slots] for t in self.k]
        view.v = view.k
        return view

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None = None) -> None:
        # rows: [B]; positions: [B, T]; k: [B, T, 1, latent_dim] (v is the same entries)
        self.k[layer][rows.view(-1, 1), 0, positions] = k[:, :, 0].to(self.k[layer].dtype)

    @staticmethod
    def bytes_per_token(layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        return layers * latent_dim * torch.empty((), dtype=dtype).element_size()


class LatentAttention(nn.Module):
    """MLA with the latent cache; `in_dim` may differ from `hidden` (an EAGLE-3 layer reads 2H)."""

    def __init__(self, in_dim: int, hidden: int, dims: MlaDims, bias: bool = False) -> None:
        super().__init__()
        d = dims
        self.dims = d
        q_out = d.num_heads * d.qk_head_dim
        if d.q_lora_rank is None:
            self.q_proj = Linear(in_dim, q_out, bias=False)
        else:
            self.q_a_proj = Linear(in_dim, d.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(d.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(in_dim, d.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim + d.v_head_dim), bias=False)
        self.o_proj = Linear(d.num_heads * d.v_head_dim, hidden, bias=bias)
        self.scale = d.softmax_scale()

    def _rope(self, x, cos, sin):
        return apply_rope_interleaved(x, cos, sin) if self.dims.rope_interleave else apply_rope(x, cos, sin)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, in_dim] -> q_nope [B, T, H, dn], q_rope [B, T, H, dr], entry [B, T, 1, r + dr]
        d = self.dims
        B, T, _ = x.shape
        q = self.q_proj(x) if d.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(B, T, d.num_heads, d.qk_head_dim).split(
            [d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        k_rope = self._rope(k_rope.unsqueeze(2), cos, sin)
        entry = torch.cat((self.kv_a_layernorm(latent).unsqueeze(2), k_rope), dim=-1)
        return q_nope, self._rope(q_rope, cos, sin), entry

    def _up_weights(self):
        # kv_b_proj [H * (dn + dv), r] -> W_UK [H, dn, r], W_UV [H, dv, r]
        d = self.dims
        w = self.kv_b_proj.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim, d.kv_lora_rank)
        return w.split([d.qk_nope_head_dim, d.v_head_dim], dim=1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: LatentCache,
                layer: int, batch: AttentionBatch) -> torch.Tensor:
        # x: [B, T, in_dim] -> [B, T, hidden]
        q_nope, q_rope, entry = self.project(x, cos, sin)
        B, T = x.shape[:2]
        # the kernel path is tested first: a compiled prefill then never guards on the prompt length
        if not batch.use_kernel and T > ABSORB_MAX_QUERIES:
            out = self._expanded(q_nope, q_rope, entry, cache, layer, batch)
        else:
            out = self._absorbed(q_nope, q_rope, entry, cache, layer, batch)
        return self.o_proj(out.reshape(B, T, -1))

    def _absorbed(self, q_nope, q_rope, entry, cache, layer, batch):
        # -> [B, T, H, dv]: multi-query attention over the cached latents themselves
        w_uk, w_uv = self._up_weights()
        q_latent = project_heads(q_nope, w_uk.transpose(1, 2))
        q = torch.cat((q_latent, q_rope), dim=-1)
        out = attend_latent(q, entry, cache, layer, batch, self.scale, self.dims.kv_lora_rank)
        return project_heads(out, w_uv)

    def _expanded(self, q_nope, q_rope, entry, cache, layer, batch):
        # -> [B, T, H, dv]: per-head keys and values rebuilt from the latents of the rows' first
        # kv_len positions (reference path only)
        d = self.dims
        rows = batch.cache_rows(q_nope.shape[0], q_nope.device)
        cache.write(layer, rows, batch.positions, entry)
        kv_len = batch.key_index.shape[0]
        cached = cache.k[layer][rows, 0, :kv_len].to(q_nope.dtype)             # [B, L, r + dr]
        latent, k_rope = cached.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = self._up_weights()
        k_nope = torch.einsum("blr,hdr->bhld", latent, w_uk)
        values = torch.einsum("blr,hvr->bhlv", latent, w_uv)
        keys = torch.cat((k_nope, k_rope.unsqueeze(1).expand(-1, d.num_heads, -1, -1)), dim=-1)
        query = torch.cat((q_nope, q_rope), dim=-1).transpose(1, 2)            # [B, H, T, dn + dr]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=batch.mask, scale=self.scale)
        return out.transpose(1, 2)

