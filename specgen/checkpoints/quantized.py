"""Quantised checkpoint weights, dequantised on load: DeepSeek's block FP8.

Contract: `dequantize_fp8_block(weight, scale_inv, block)` returns the float32 weight of an
`F8_E4M3` tensor `[O, I]` stored with a `weight_scale_inv [ceil(O / bo), ceil(I / bo)]` float32
tensor: every `bo x bi` block of the weight times its scale (the name is DeepSeek's: the value
stored is the inverse of the quantiser's scale, i.e. the multiplier back to real values; see
DeepSeek-V3's `inference/fp8_cast_bf16.py` and `../shared/reference/checkpoints`).
`dequantize_state(state, where)` finds every `X.weight` + `X.weight_scale_inv` pair in a dict of
tensors read from a checkpoint and replaces the pair by the dequantised `X.weight`, cast to the run's
dtype; a scale without its weight, or a weight in FP8 without a scale, is a `CheckpointError`.
"""

from __future__ import annotations

import math

import torch

from specgen.checkpoints.store import CheckpointError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] | None = None) -> torch.Tensor:
    # weight: [O, I] float8; scale_inv: [ceil(O / bo), ceil(I / bi)] -> [O, I] float32
    rows, cols = weight.shape
    if block is None:   # DeepSeek's configs say [128, 128]; infer it from the scale's shape otherwise
        block = (math.ceil(rows / scale_inv.shape[0]), math.ceil(cols / scale_inv.shape[1]))
    bo, bi = block
    if tuple(scale_inv.shape) != (math.ceil(rows / bo), math.ceil(cols / bi)):
        raise ValueError(f"scale shape {list(scale_inv.shape)} does not tile a {rows}x{cols} weight "
                         f"in {bo}x{bi} blocks")
    scale = scale_inv.float().repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return weight.float() * scale


def is_scale(key: str) -> bool:
    return key.endswith(SCALE_SUFFIX)


def dequantize_state(state: dict[str, torch.Tensor], *, dtype: torch.dtype | None, where: str,
                     block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Replace each FP8 `X.weight` + `X.weight_scale_inv` pair by the dequantised weight, in place."""
    for key in [k for k in state if is_scale(k)]:
        weight_key = key[: -len(SCALE_SUFFIX)]
        if weight_key not in state:
            raise CheckpointError(f"{where}: {key} has no {weight_key} beside it")
        try:
            real = dequantize_fp8_block(state[weight_key], state.pop(key), block)
        except ValueError as err:
            raise CheckpointError(f"{where}: {weight_key}: {err}") from err
        state[weight_key] = real.to(dtype) if dtype is not None else real
    left = [k for k, v in state.items() if v.dtype in FP8_DTYPES]
    if left:
        raise CheckpointError(f"{where}: FP8 tensors without a weight_scale_inv: {', '.join(left[:4])}")
    return state
