"""Tensor parallelism for the targets: which slice of each weight a rank holds, and the collective
that joins the slices.

Contract:
- `TensorParallel(rank, size, group)`: this process's place in a tensor-parallel group (a
  torch.distributed process group of `size` ranks). `size == 1` is no parallelism at all.
- Layout (Megatron's, as vLLM and torch's `ColwiseParallel` / `RowwiseParallel` split a decoder):
  rank r of N holds query heads [r H/N, (r+1) H/N), the KV heads those read (GQA groups never
  straddle ranks), and the same share of the MLP's intermediate rows. The projections into a layer
  (fused q|k|v, fused gate|up) are split by output rows, so each rank computes its heads and its
  share of the MLP with no communication; the projections out (o_proj, down_proj) are split by input
  columns, so each rank holds a partial sum, and `ReducedLinear` adds them over the group (one
  all-reduce after attention and one after the MLP, through torch's functional collectives, which
  torch.compile traces into the step). Embedding, norms and the LM head are replicated: every rank
  computes the same logits from the same reduced hidden state, so every rank verifies the same
  drafts with the same keyed noise and takes the same decisions with no further communication.
- MoE (DeepSeek-V3, Kimi K2.5): the router is replicated; each routed expert's rows are split like
  the MLP's, or with `expert_parallel` each rank holds whole experts (E/N of them, in rank order)
  and a pair routed elsewhere adds nothing on this rank; the shared experts are split like the MLP.
  The routed and shared partial sums meet in one all-reduce. MLA (models/mla.py) splits its heads
  (q_proj / q_b_proj and kv_b_proj rows, o_proj columns); the latent cache is whole on every rank
  (every rank projects the same latents), as vLLM keeps it.
- `rank_shape(cfg, tp)`: the config of one rank's slice (the config class's `sharded(tp)`: its heads,
  KV heads, intermediate sizes, experts; everything else as is), what the rank's modules, cache and
  memory estimate are built from. A size that does not divide them is a ValueError naming it.
- `shard_fused_state(state, cfg, tp, prefixes)`: a converted (fused) Llama state cut to this rank's
  slice, in place (models/deepseek_v3.py has its own); `reduced(linear, tp)` is a layer's
  `ReducedLinear` (same parameter names, so a sliced state loads as any other). Block-FP8 weights
  kept as FP8 are cut with their scales (`split_rows`, `split_block`), where each rank's share fills
  whole blocks (DeepSeek-V3's do at 2, 4 and 8 ranks), else a ValueError says so.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from specgen.models.layers import fp8_block_of
from specgen.models.products import project
from specgen.models.tensor_header import ShapeMismatch


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object | None = None
    expert_parallel: bool = False   # MoE: whole routed experts per rank (else each expert's rows split)

    @property
    def active(self) -> bool:
        return self.size > 1


class ReducedLinear(nn.Linear):
    """A linear layer whose input features are split over the group: x W_r^T on each rank, summed
    over the ranks (a bias, if any, is added once, after the sum)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, group=None,
                 device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        partial = project(x, self.weight)
        total = funcol.all_reduce(partial, "sum", self.group)
        return total if self.bias is None else total + self.bias


def split_evenly(total: int, tp: TensorParallel, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"runtime.tensor_parallel_size {tp.size} does not divide the target's {what} ({total})")
    return total // tp.size


def rank_shape(cfg, tp: TensorParallel):
    """A target's config cut to one rank's slice (the config class's `sharded(tp)`)."""
    return cfg.sharded(tp) if tp.active else cfg


def llama_sharded(cfg, tp: TensorParallel):
    """A Llama-style config (num_heads, num_kv_heads, intermediate_size) cut to one rank's slice."""
    return replace(cfg, num_heads=split_evenly(cfg.num_heads, tp, "attention heads"),
                   num_kv_heads=split_evenly(cfg.num_kv_heads, tp, "KV heads"),
                   intermediate_size=split_evenly(cfg.intermediate_size, tp, "intermediate size"))


def rows(tensor: torch.Tensor, parts: list[int], tp: TensorParallel, dim: int = 0) -> torch.Tensor:
    """Of a tensor stacked along `dim` from `parts` (e.g. q|k|v, gate|up), each part's r-th of N
    blocks. (chunk / split / cat only: a dry load's `TensorHeader`s take the same path.)"""
    return torch.cat([piece.chunk(tp.size, dim=dim)[tp.rank] for piece in tensor.split(parts, dim=dim)],
                     dim=dim).contiguous()


def scale_key(key: str) -> str:
    """The block-FP8 scales of a weight kept as FP8 (models/fp8_layers.py): `X.weight` ->
    `X.weight_scale_inv`, a stacked `experts.gate_up_proj` -> `experts.gate_up_proj_scale_inv`."""
    return key + "_scale_inv"


def _scale_parts(state: dict, key: str, parts: list[int], dim: int, tp: TensorParallel) -> list[int] | None:
    """`parts` in blocks of the FP8 scale beside `key` (None: no scale there). Each rank's share of
    each part must fill whole blocks: a block split between ranks has no scale of its own."""
    if scale_key(key) not in state:
        return None
    weight, scale = state[key], state[scale_key(key)]
    if dim < weight.ndim - 2:
        return parts                    # the experts of a stack: a scale grid each, not blocks
    size = fp8_block_of(weight.shape, scale.shape)
    if any((part // tp.size) % size for part in parts):
        raise ShapeMismatch(f"runtime.tensor_parallel_size {tp.size} cuts {key} ({weight.shape[dim]} along dim {dim}) "
                         f"inside its {size}-wide FP8 blocks; set target.fp8_weights: dequantize")
    return [part // size for part in parts]


def split_rows(state: dict, key: str, parts: list[int], tp: TensorParallel, dim: int = 0) -> None:
    """`rows` on a state's tensor, in place, and on its FP8 scales alike."""
    scale_parts = _scale_parts(state, key, parts, dim, tp)
    state[key] = rows(state[key], parts, tp, dim)
    if scale_parts is not None:
        state[scale_key(key)] = rows(state[scale_key(key)], scale_parts, tp, dim)


def split_block(state: dict, key: str, tp: TensorParallel, dim: int) -> None:
    """`block` on a state's tensor, in place, and on its FP8 scales alike."""
    split_rows(state, key, [state[key].shape[dim]], tp, dim)


def shard_gated_mlp(state: dict, prefix: str, intermediate: int, tp: TensorParallel) -> None:
    """A fused gated MLP under `prefix` (`gate_up_proj` rows, `down_proj` columns), in place."""
    split_rows(state, f"{prefix}gate_up_proj.weight", [intermediate] * 2, tp)
    split_block(state, f"{prefix}down_proj.weight", tp, dim=1)


def shard_fused_state(state: dict, cfg, tp: TensorParallel, prefixes: list[str]) -> dict:
    """Cut each layer under `prefixes` (`...layers.{i}.`) to this rank's heads and MLP rows, in
    place. `cfg` is the whole model's (heads, KV heads, head_dim, intermediate size)."""
    if not tp.active:
        return state
    d = cfg.head_dim
    qkv = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
    for prefix in prefixes:
        for kind in ("weight", "bias"):
            name = f"{prefix}self_attn.qkv_proj.{kind}"
            if name in state:
                split_rows(state, name, qkv, tp)
        split_block(state, f"{prefix}self_attn.o_proj.weight", tp, dim=1)
        shard_gated_mlp(state, f"{prefix}mlp.", cfg.intermediate_size, tp)
    return state


def reduced(linear: nn.Linear, tp: TensorParallel) -> nn.Linear:
    """`linear` (built for this rank's input columns) as a `ReducedLinear` over the group."""
    if not tp.active:
        return linear
    return ReducedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None, group=tp.group,
                         device=linear.weight.device, dtype=linear.weight.dtype)
