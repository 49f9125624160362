"""Building blocks shared by our model code: RMSNorm, rotary embeddings, cached attention, gated MLP.

Contract: every function here works on explicit tensors and static shapes. Attention reads and writes
a preallocated KV cache at per-row positions (`positions[B, T]`), so one batch may hold slots of
different lengths; nothing here synchronises with the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementations: half-precision variance drifts.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


# ---------------------------------------------------------------------------------------------- RoPE


@dataclass(frozen=True, slots=True)
class RopeSettings:
    """Rotary settings read from an HF config, in either spelling (`rope_theta` + `rope_scaling`, or
    the `rope_parameters` dict that transformers 5 writes)."""

    theta: float
    rope_type: str = "default"
    params: dict = field(default_factory=dict)

    @classmethod
    def from_hf(cls, config: dict) -> RopeSettings:
        params = dict(config.get("rope_parameters") or {})
        scaling = config.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = params.pop("rope_theta", None) or config.get("rope_theta") or 10000.0
        rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default, linear, llama3)")
        return cls(theta=float(theta), rope_type=rope_type, params=params)


def rope_inv_freq(head_dim: int, rope: RopeSettings) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with llama3 / linear scaling applied."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / float(rope.params["factor"])
    if rope.rope_type == "llama3":
        factor = float(rope.params["factor"])
        low = float(rope.params.get("low_freq_factor", 1.0))
        high = float(rope.params.get("high_freq_factor", 4.0))
        old_len = float(rope.params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(in_band, blended, scaled)
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    # positions: [B, T] int64 -> cos, sin: [B, 1, T, head_dim] (broadcast over heads)
    freqs = positions.unsqueeze(-1).float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, D]; rotate-half convention (HF Llama weights are permuted for it)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------- KV cache


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

    @staticmethod
    def bytes_needed(layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int,
                     dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * layers * slots * kv_heads * max_len * head_dim * itemsize


def causal_mask(positions: torch.Tensor, kv_len: int) -> torch.Tensor:
    # positions: [B, T] -> [B, 1, T, kv_len] bool; a query sees every key at or before its position.
    keys = torch.arange(kv_len, device=positions.device)
    return (keys.view(1, 1, 1, kv_len) <= positions.view(positions.shape[0], 1, -1, 1))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, layer: int,
                     positions: torch.Tensor, mask: torch.Tensor, kv_len: int,
                     slots: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    # q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; positions: [B, T]; mask: [B, 1, T, kv_len]
    # slots: [B] cache rows of this batch, or None when the batch is all slots in order (the step).
    batch, kv_heads = k.shape[0], k.shape[1]
    rows = slots if slots is not None else torch.arange(batch, device=q.device)
    heads = torch.arange(kv_heads, device=q.device)
    index = (rows.view(-1, 1, 1), heads.view(1, -1, 1), positions.unsqueeze(1))
    cache.k[layer].index_put_(index, k)
    cache.v[layer].index_put_(index, v)
    keys, values = cache.k[layer][:, :, :kv_len], cache.v[layer][:, :, :kv_len]
    if slots is not None:
        keys, values = keys[slots], values[slots]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != kv_heads)


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one matmul (`gate_up_proj` = cat(gate, up))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fuse_rows(*weights: torch.Tensor) -> torch.Tensor:
    """Concatenate projection weights along the output dimension (q|k|v, gate|up)."""
    return torch.cat(weights, dim=0)


class CachedSelfAttention(nn.Module):
    """Multi-head attention with GQA over a static KV cache; q, k and v fused into `qkv_proj`.

    `in_dim` may differ from the model width (EAGLE-3's layer reads 2H-wide inputs)."""

    def __init__(self, in_dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 bias: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = nn.Linear(in_dim, (heads + 2 * kv_heads) * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                layer: int, positions: torch.Tensor, mask: torch.Tensor, kv_len: int,
                slots: torch.Tensor | None) -> torch.Tensor:
        # x: [B, T, in_dim] -> [B, T, hidden]
        batch, length, _ = x.shape
        q, k, v = self.qkv_proj(x).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim],
            dim=-1)
        q = q.view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = cached_attention(q, k, v, cache, layer, positions, mask, kv_len, slots)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


def fuse_attention_and_mlp_keys(state: dict[str, torch.Tensor], prefix: str) -> None:
    """Rewrite HF `{q,k,v}_proj` / `{gate,up}_proj` keys under `prefix` into our fused ones, in place."""
    for kind in ("weight", "bias"):
        names = [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
        if all(n in state for n in names):
            state[f"{prefix}self_attn.qkv_proj.{kind}"] = fuse_rows(*(state.pop(n) for n in names))
    gate, up = f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"
    if gate in state and up in state:
        state[f"{prefix}mlp.gate_up_proj.weight"] = fuse_rows(state.pop(gate), state.pop(up))
