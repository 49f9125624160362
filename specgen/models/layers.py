"""Building blocks shared by our model code: RMSNorm, rotary embeddings, cached attention, gated MLP.

Contract: every function here works on explicit tensors and static shapes, in the `[B, T, heads,
head_dim]` layout. Attention reads and writes a preallocated KV cache at per-row positions through
`models/attention.py`, so one batch may hold slots of different lengths; nothing here synchronises
with the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specgen.models.attention import AttentionBatch, KVCache, attend
from specgen.models.products import Linear, project
from specgen.models.tensor_header import ShapeMismatch


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
        if rope_type not in ("default", "linear", "llama3", "yarn"):
            raise ValueError(f"rope type {rope_type!r} is not supported (default, linear, llama3, yarn)")
        if rope_type == "yarn" and not params.get("factor"):
            raise ValueError("yarn rope scaling needs a factor")
        return cls(theta=float(theta), rope_type=rope_type, params=params)

    def attention_factor(self) -> float:
        """YaRN's scale on cos and sin (1 for every other type): mscale / mscale_all_dim when both are
        given (DeepSeek-V3: 1.0), else 0.1 ln(factor) + 1 (the YaRN paper), as transformers does."""
        if self.rope_type != "yarn":
            return 1.0
        given = self.params.get("attention_factor")
        if given is not None:
            return float(given)
        factor = float(self.params["factor"])
        mscale, mscale_all_dim = self.params.get("mscale"), self.params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        return yarn_mscale(factor)

    def softmax_scale_factor(self) -> float:
        """The factor on 1/sqrt(d) of DeepSeek's MLA softmax under YaRN: mscale(factor, mscale_all_dim)^2."""
        mscale_all_dim = self.params.get("mscale_all_dim") if self.rope_type == "yarn" else None
        if not mscale_all_dim:
            return 1.0
        return yarn_mscale(float(self.params["factor"]), float(mscale_all_dim)) ** 2


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, rope)
    return inv_freq


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, rope: RopeSettings) -> torch.Tensor:
    """YaRN: dimensions that rotate fewer than `beta_slow` times over the original context are
    interpolated (slowed by `factor`), those rotating more than `beta_fast` times kept, a linear ramp
    between; the ramp bounds are rounded outwards (`truncate`, on unless the config says otherwise)."""
    factor = float(rope.params["factor"])
    old_len = float(rope.params["original_max_position_embeddings"])
    beta_fast = float(rope.params.get("beta_fast") or 32)
    beta_slow = float(rope.params.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        # the dimension index whose wavelength fits `rotations` times into the original context
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if rope.params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                       # 1 = extrapolate (keep the frequency), 0 = interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    # positions: [B, T] int64 -> cos, sin: [B, T, 1, head_dim] (broadcast over heads of [B, T, H, D])
    # `scale`: YaRN's attention factor (RopeSettings.attention_factor), 1 otherwise
    if torch.compiler.is_compiling():
        cos, sin = _rope_angles(positions, inv_freq, scale)
    else:
        cos, sin = _rope_angles_eager(positions, inv_freq, scale)
    return cos.to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


def _rope_angles_eager(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float):
    # positions: [B, T] int64; inv_freq: [D / 2] -> cos, sin: [B, T, D] float32
    freqs = positions.unsqueeze(-1).float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


# Compiled, cos and sin come from an opaque op, so Inductor stores them once per forward. As plain
# pointwise code it recomputed them wherever they are read, and the query's rotation is read inside
# the attention's loop over keys: two vector cos/sin per key, head and query row (Inductor's CPU
# heuristic stores reused exp/log/tanh results, not cos/sin). Measured on SmolLM2, fp32, batch 1,
# 2 AMD EPYC Zen 4 cores, kv bucket 512: the attention kernels took 3.8 ms of a 1-row verify and
# 8.8 ms of a 3-row one; with stored cos/sin, 2.9 and 4.4. The op runs the eager code above, so
# compiled and eager steps rotate with the same bits.
@torch.library.custom_op("specgen::rope_angles", mutates_args=())
def _rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_angles_eager(positions, inv_freq, scale)


@_rope_angles.register_fake
def _(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*positions.shape, 2 * inv_freq.shape[0])
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D]; rotate-half convention (HF Llama weights are permuted for it)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, H, D] whose rotary dims come in adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek's
    # layout); cos, sin: [B, T, 1, D] = cat(f, f). The output is in rotate-half order, as
    # transformers' DeepseekV3 returns it: queries and keys are both permuted, so scores are unchanged.
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * c - odd * s, odd * c + even * s), dim=-1)


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up fused into one matmul (`gate_up_proj` = cat(gate, up))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def fuse_rows(*weights: torch.Tensor) -> torch.Tensor:
    """Concatenate projection weights along the output dimension (q|k|v, gate|up)."""
    return torch.cat(weights, dim=0)


def fp8_block_of(weight_shape, scale_shape) -> int:
    """The square block of a block-FP8 weight, from its shape and its scales' (ceil(n / b) = s along
    both dims; the power of two that fits, as every release uses, else the smallest that fits)."""
    lo, hi = 1, 1 << 62
    for n, s in zip(weight_shape[-2:], scale_shape[-2:]):
        lo = max(lo, -(-n // s))
        if s > 1:
            hi = min(hi, -(-n // (s - 1)) - 1)
    b = 1 << max(0, lo - 1).bit_length()          # the smallest power of two >= lo
    return b if b <= hi else lo


def fuse_scale_rows(state: dict, names: list[str]) -> torch.Tensor:
    """Block-FP8 scales (`X.weight_scale_inv`, state still holding each `X.weight`) fused as their
    weights will be: only weights whose rows fill whole blocks fuse (else a block would straddle
    two of them)."""
    for name in names:
        weight, scale = state[name.removesuffix("_scale_inv")], state[name]
        block = fp8_block_of(weight.shape, scale.shape)
        if weight.shape[-2] % block:
            raise ShapeMismatch(f"{name.removesuffix('_scale_inv')}: {weight.shape[-2]} rows do not fill "
                                f"{block}-row FP8 blocks, so it cannot be fused with its neighbours as FP8")
    return fuse_rows(*(state.pop(n) for n in names))


class CachedSelfAttention(nn.Module):
    """Multi-head attention with GQA over a static KV cache; q, k and v fused into `qkv_proj`.

    `in_dim` may differ from the model width (EAGLE-3's layer reads 2H-wide inputs)."""

    def __init__(self, in_dim: int, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 bias: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = Linear(in_dim, (heads + 2 * kv_heads) * head_dim, bias=bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [B, T, in_dim] -> q [B, T, Hq, D], k and v [B, T, Hkv, D], RoPE applied to q and k
        B, T, _ = x.shape
        d = self.head_dim
        # heads first, then the split: a view of a split slice would make a compiled step with a
        # dynamic T specialise on T == 1 (pipelines/compiled.py)
        qkv = self.qkv_proj(x).view(B, T, self.heads + 2 * self.kv_heads, d)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                layer: int, batch: AttentionBatch) -> torch.Tensor:
        # x: [B, T, in_dim] -> [B, T, hidden]
        out = attend(*self.project(x, cos, sin), cache, layer, batch)
        return self.o_proj(out.reshape(*x.shape[:2], -1))


# attention(module, x, cos, sin) -> [B, T, hidden]: how a layer's self-attention reaches its keys.
# Inference binds a KV cache (`cached`); draft training binds its own key memory (training/unroll.py).
Attention = Callable[[CachedSelfAttention, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cached(cache: KVCache, layer: int, batch: AttentionBatch) -> Attention:
    """Attention through the KV cache at `batch`'s positions (the inference path)."""
    return lambda module, x, cos, sin: module(x, cos, sin, cache, layer, batch)


def fuse_attention_and_mlp_keys(state: dict[str, torch.Tensor], prefix: str) -> None:
    """Rewrite HF `{q,k,v}_proj` / `{gate,up}_proj` keys under `prefix` into our fused ones, in place
    (block-FP8 weights kept as FP8 bring their `weight_scale_inv`, fused alike)."""
    for kind in ("weight_scale_inv", "weight", "bias"):     # scales first: they check their weights
        names = [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
        if all(n in state for n in names):
            fuse = fuse_scale_rows(state, names) if kind == "weight_scale_inv" else fuse_rows(*(state.pop(n) for n in names))
            state[f"{prefix}self_attn.qkv_proj.{kind}"] = fuse
    for kind in ("weight_scale_inv", "weight"):
        names = [f"{prefix}mlp.gate_proj.{kind}", f"{prefix}mlp.up_proj.{kind}"]
        if all(n in state for n in names):
            fuse = fuse_scale_rows(state, names) if kind == "weight_scale_inv" else fuse_rows(*(state.pop(n) for n in names))
            state[f"{prefix}mlp.gate_up_proj.{kind}"] = fuse


def split_attention_and_mlp_keys(state: dict[str, torch.Tensor], prefix: str, q_rows: int,
                                 kv_rows: int) -> None:
    """The inverse of `fuse_attention_and_mlp_keys` (export in the published layouts), in place."""
    for kind in ("weight", "bias"):
        fused = f"{prefix}self_attn.qkv_proj.{kind}"
        if fused in state:
            q, k, v = state.pop(fused).split([q_rows, kv_rows, kv_rows], dim=0)
            for name, part in zip("qkv", (q, k, v)):
                state[f"{prefix}self_attn.{name}_proj.{kind}"] = part.contiguous()
    fused = f"{prefix}mlp.gate_up_proj.weight"
    if fused in state:
        gate, up = state.pop(fused).chunk(2, dim=0)
        state[f"{prefix}mlp.gate_proj.weight"] = gate.contiguous()
        state[f"{prefix}mlp.up_proj.weight"] = up.contiguous()


def float32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """LM head whose output is float32 straight from the GEMM (GPU_NOTES 8).

    Verification compares logits from GEMMs with M = B(K+1) rows against plain decoding's M = B;
    they tile differently, and rounding their outputs to bf16 would turn small differences into
    ties that flip. On CUDA the half-precision GEMM accumulates in fp32 and writes fp32
    (`out_dtype`); on CPU the BLAS's half-precision output is cast, and an eager step's
    row-invariant product (models/products.py) writes fp32 from its accumulators."""
    # hidden: [..., H]; weight: [V, H] -> [..., V] float32
    if weight.dtype == torch.float32:
        return project(hidden, weight)
    if hidden.is_cuda:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return torch.mm(flat, weight.t(), out_dtype=torch.float32).view(*hidden.shape[:-1], -1)
    return project(hidden, weight, out_dtype=torch.float32)
