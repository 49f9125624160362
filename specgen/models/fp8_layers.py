"""Block-FP8 weights kept as FP8 in a target: the layers that hold them, and the swap that puts them in.

Contract: `with_fp8_layers(model, state)` takes a model just built on the meta device and the state
it is about to load; for every FP8 weight of the state (an e4m3 `X.weight` beside its float32
`X.weight_scale_inv`, checkpoints/quantized.py with `keep_fp8`) it puts in a layer that stores that
weight as FP8 and multiplies block-scaled (kernels/block_fp8.py): `BlockFP8Linear` for an
`nn.Linear`, and the FP8 form of a MoE's stacked routed experts (`experts.gate_up_proj_scale_inv`,
`experts.down_proj_scale_inv`: models/moe.py). The layers keep the parameter names, so the state
loads as it is. The block is read from the shapes (square blocks: DeepSeek's 128 x 128).
Activations are quantised to FP8 in 1 x block slices on the fly, as DeepSeek's own inference does, so
a kept layer's output differs from a dequantised one's by that rounding (a few per mille of a slice's
largest value); outputs stay exact against plain decoding with the same kept weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specgen.errors import CheckpointError
from specgen.kernels import block_fp8
from specgen.models.layers import fp8_block_of
from specgen.models.products import Linear
from specgen.models.tensor_parallel import ReducedLinear

SCALE = "weight_scale_inv"


class BlockFP8Linear(nn.Module):
    """y = x W^T (+ b) with W stored FP8 [out, in] and a float32 scale per block. `group`: a
    tensor-parallel rank's slice of input columns, summed over the group as `ReducedLinear` does
    (models/tensor_parallel.py)."""

    def __init__(self, in_features: int, out_features: int, block: int, bias: bool = False, group=None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block, self.group = in_features, out_features, block, group
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=block_fp8.FP8), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(math.ceil(out_features / block), math.ceil(in_features / block)), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.specgen.block_fp8_linear(flat, self.weight, self.weight_scale_inv, self.block)
        out = out.view(*x.shape[:-1], self.out_features)
        if self.group is not None:
            from torch.distributed import _functional_collectives as funcol

            out = funcol.all_reduce(out, "sum", self.group)
        return out if self.bias is None else out + self.bias


def with_fp8_layers(model: nn.Module, state: dict | None) -> nn.Module:
    """`model` with an FP8 layer wherever `state` keeps an FP8 weight (see the module docstring).
    Weights the model reads as matrices rather than multiplies by (`model.FP8_DEQUANTIZED`: MLA's
    kv_b_proj, whose per-head blocks absorb into the queries) are dequantised in `state` instead."""
    if not state:
        return model
    for key in [k for k in state if k.endswith("." + SCALE)]:
        path = key[: -len("." + SCALE)]
        if path.endswith(getattr(model, "FP8_DEQUANTIZED", ())):
            weight, scale = state[path + ".weight"], state.pop(key)
            state[path + ".weight"] = weight.float() if not isinstance(weight, torch.Tensor) else \
                block_fp8.dequantize_weight(weight, scale, fp8_block_of(weight.shape, scale.shape))
    for key, scale in state.items():
        if key.endswith("experts.gate_up_proj_scale_inv"):
            experts = model.get_submodule(key[: -len(".gate_up_proj_scale_inv")])
            experts.keep_fp8(fp8_block_of(state[key[: -len("_scale_inv")]].shape, scale.shape))
        elif key.endswith("." + SCALE):
            path = key[: -len("." + SCALE)]
            linear = model.get_submodule(path)
            if type(linear) not in (nn.Linear, Linear, ReducedLinear):
                raise CheckpointError(f"{path}: an FP8 weight where specgen's model has a {type(linear).__name__}, "
                                      "which multiplies only dequantised weights")
            parent, _, name = path.rpartition(".")
            layer = BlockFP8Linear(linear.in_features, linear.out_features,
                                   fp8_block_of(state[path + ".weight"].shape, scale.shape), linear.bias is not None,
                                   group=getattr(linear, "group", None))
            setattr(model.get_submodule(parent) if parent else model, name, layer)
    return model
