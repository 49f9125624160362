"""Quantised checkpoint weights, dequantised on load: DeepSeek's block FP8 and Kimi's packed INT4.

Contract:
- `quantization_of(config, where)` reads what a checkpoint's `quantization_config` (top level, or
  under `text_config` for Kimi K2.5) says into a `Quantization`, None for a plain checkpoint, and
  raises `CheckpointError` for a scheme specgen cannot dequantise (naming it).
- Block FP8 (DeepSeek-V3 `quant_method: fp8`): `X.weight` in F8_E4M3 `[O, I]` beside
  `X.weight_scale_inv [ceil(O / bo), ceil(I / bi)]` float32, the multiplier back to real values of
  each `bo x bi` block (DeepSeek's name; see DeepSeek-V3's `inference/fp8_cast_bf16.py`).
- Packed INT4 (compressed-tensors `pack-quantized`, symmetric, group strategy: Kimi K2.5's routed
  experts): `X.weight_packed [O, ceil(I / 8)]` int32 holding eight 4-bit values each, lowest bits
  first, stored as value + 8; `X.weight_scale [O, ceil(I / g)]` per group of g inputs;
  `X.weight_shape [2]` = [O, I]. Real value = (stored - 8) x scale.
- With `Quantization.keep_fp8`, block FP8 weights stay as stored (`X.weight` e4m3 beside
  `X.weight_scale_inv` float32) for GEMMs that multiply FP8 (kernels/block_fp8.py).
- With `Quantization.keep_int4`, packed INT4 routed experts (`...experts.{e}.X.weight_packed`) stay
  packed: `X.weight_packed` and `X.weight_scale` as stored (kernels/int4_experts.py multiplies them),
  `X.weight_shape` checked against the packing and dropped. Other packed weights are dequantised.
- `dequantize_state(state, quantization, dtype=, where=)` replaces every such group of tensors by the
  dequantised `X.weight` in the run's dtype, in place; leftovers (a scale without its weight, FP8 or
  packed tensors without scales) are a `CheckpointError` naming the tensor. Given `TensorHeader`s
  (a dry load), it runs the same shape checks and gives headers of the dequantised weights; the
  packed INT4 shape then comes from the packed tensor (`weight_shape`'s values are data).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from specgen.checkpoints.headers import TensorHeader
from specgen.checkpoints.store import CheckpointError
from specgen.kernels.int4_experts import unpack_codes

FP8_SCALE = "weight_scale_inv"
INT4_PACKED, INT4_SCALE, INT4_SHAPE = "weight_packed", "weight_scale", "weight_shape"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_SUFFIXES = (FP8_SCALE, INT4_PACKED, INT4_SCALE, INT4_SHAPE)
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")      # whose packed INT4 weights `keep_int4` keeps


@dataclass(frozen=True, slots=True)
class Quantization:
    fp8_block: tuple[int, int] | None = None    # block FP8: the block shape
    int4_group: int | None = None               # packed INT4: inputs per scale
    keep_fp8: bool = False                      # block FP8 stays FP8, beside its scales (kernels/block_fp8.py)
    keep_int4: bool = False                     # packed INT4 routed experts stay packed (kernels/int4_experts.py)


def quantization_of(config: dict, where: str) -> Quantization | None:
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "fp8" and quant.get("fmt", "e4m3") == "e4m3":
        block = quant.get("weight_block_size") or (128, 128)
        return Quantization(fp8_block=(int(block[0]), int(block[1])))
    if method == "compressed-tensors" and quant.get("format") == "pack-quantized":
        groups = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values()]
        sizes = {w.get("group_size") for w in groups}
        if groups and all(w.get("num_bits") == 4 and w.get("type") == "int" and w.get("symmetric")
                          and w.get("strategy") == "group" for w in groups) and len(sizes) == 1:
            return Quantization(int4_group=int(sizes.pop()))
    raise CheckpointError(f"{where}: quantization {method!r} ({quant.get('format') or quant.get('fmt')}) is not "
                          "supported (block FP8 e4m3 and symmetric group INT4 pack-quantized are; dequantise "
                          "the checkpoint to bf16 first, and drop quantization_config)")


def is_quantized_part(key: str, tensor: torch.Tensor) -> bool:
    """Tensors read as they are stored (not cast to the run dtype) until `dequantize_state`."""
    return tensor.dtype in FP8_DTYPES or key.endswith(QUANTIZED_SUFFIXES)


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] | None = None) -> torch.Tensor:
    # weight: [O, I] float8; scale_inv: [ceil(O / bo), ceil(I / bi)] -> [O, I] float32
    rows, cols = weight.shape
    if block is None:
        block = (math.ceil(rows / scale_inv.shape[0]), math.ceil(cols / scale_inv.shape[1]))
    bo, bi = block
    if tuple(scale_inv.shape) != (math.ceil(rows / bo), math.ceil(cols / bi)):
        raise ValueError(f"scale shape {list(scale_inv.shape)} does not tile a {rows}x{cols} weight "
                         f"in {bo}x{bi} blocks")
    if isinstance(weight, TensorHeader):
        return weight.float()
    scale = scale_inv.float().repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return weight.float() * scale


def dequantize_int4_packed(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor | tuple[int, int],
                           group: int | None = None) -> torch.Tensor:
    # packed: [O, ceil(I / 8)] int32; scale: [O, ceil(I / g)]; shape: (O, I) -> [O, I] float32
    rows, cols = (int(s) for s in shape)
    if packed.shape[0] != rows or packed.shape[1] != math.ceil(cols / 8):
        raise ValueError(f"packed shape {list(packed.shape)} does not hold a {rows}x{cols} weight")
    group = group or math.ceil(cols / scale.shape[1])
    if tuple(scale.shape) != (rows, math.ceil(cols / group)):
        raise ValueError(f"scale shape {list(scale.shape)} does not match groups of {group} over {cols} inputs")
    if isinstance(packed, TensorHeader):
        return TensorHeader((rows, cols), torch.float32, packed.names + scale.names)
    values = unpack_codes(packed, cols).float() - 8
    return values * scale.float().repeat_interleave(group, 1)[:, :cols]


def dequantize_state(state: dict[str, torch.Tensor], quantization: Quantization | None, *,
                     dtype: torch.dtype | None, where: str) -> dict[str, torch.Tensor]:
    """Replace each quantised weight's tensors by the dequantised `X.weight`, in place."""
    q = quantization or Quantization()
    kept = set()
    for key in [k for k in state if k.endswith(FP8_SCALE)]:
        base = key[: -len(FP8_SCALE)]
        if q.keep_fp8 and state.get(base + "weight") is not None and state[base + "weight"].dtype == torch.float8_e4m3fn:
            _check_fp8_block(state[base + "weight"], state[key], q.fp8_block, where, base)
            state[key] = state[key].float()       # the multipliers stay float32 whatever the run's dtype
            kept |= {key, base + "weight"}
            continue
        _dequantize(state, base, where, dtype,
                    lambda: dequantize_fp8_block(_take(state, base + "weight", key, where), state.pop(key),
                                                 q.fp8_block))
    for key in [k for k in state if k.endswith(INT4_PACKED)]:
        base = key[: -len(INT4_PACKED)]
        if q.keep_int4 and ROUTED_EXPERT.search(base):
            _check_int4_kept(state, key, base, where, q.int4_group)
            kept |= {key, base + INT4_SCALE}
            continue
        _dequantize(state, base, where, dtype,
                    lambda: _dequantize_int4(state, key, base, where, q.int4_group))
    left = [k for k, v in state.items() if is_quantized_part(k, v) and k not in kept]
    if left:
        raise CheckpointError(f"{where}: quantised tensors without their scales or weights: {', '.join(left[:4])}")
    return state


def _check_fp8_block(weight, scale, block: tuple[int, int] | None, where: str, base: str) -> None:
    """A kept FP8 weight's scales must tile it in square blocks (what the GEMM kernel reads)."""
    rows, cols = weight.shape
    bo, bi = block or (math.ceil(rows / scale.shape[0]), math.ceil(cols / scale.shape[1]))
    if bo != bi or tuple(scale.shape) != (math.ceil(rows / bo), math.ceil(cols / bi)):
        raise CheckpointError(f"{where}: {base}weight: scale shape {list(scale.shape)} does not tile a "
                              f"{rows}x{cols} weight in square blocks ({bo}x{bi}), which FP8 GEMMs need")


def _check_int4_kept(state: dict, key: str, base: str, where: str, group: int | None) -> None:
    """A packed weight kept as it is must be whole words and whole groups (what the products read);
    its `weight_shape` is then implied by the packing, and dropped."""
    packed = state[key]
    scale = _take(state, base + INT4_SCALE, key, where)
    shape = _take(state, base + INT4_SHAPE, key, where)
    rows, cols = packed.shape[0], packed.shape[1] * 8
    if not isinstance(shape, TensorHeader) and [int(s) for s in shape.tolist()] != [rows, cols]:
        raise CheckpointError(f"{where}: {base}weight: weight_shape {shape.tolist()} is not the whole words of its "
                              f"packing ({rows} x {cols}); set target.quantization: none to dequantise it")
    group = group or cols // scale.shape[1]
    if cols % group or tuple(scale.shape) != (rows, cols // group):
        raise CheckpointError(f"{where}: {base}weight: scale shape {list(scale.shape)} does not match groups of "
                              f"{group} over {cols} inputs")
    state[base + INT4_SCALE] = scale


def _dequantize_int4(state: dict, key: str, base: str, where: str, group: int | None):
    packed = state.pop(key)
    scale = _take(state, base + INT4_SCALE, key, where)
    shape = _take(state, base + INT4_SHAPE, key, where)
    if isinstance(shape, TensorHeader):      # a dry load: the values are data, the packing implies them
        shape = (packed.shape[0], packed.shape[1] * 8)
    return dequantize_int4_packed(packed, scale, shape.tolist() if isinstance(shape, torch.Tensor) else shape, group)


def _take(state: dict, key: str, beside: str, where: str) -> torch.Tensor:
    if key not in state:
        raise CheckpointError(f"{where}: {beside} has no {key} beside it")
    return state.pop(key)


def _dequantize(state, base: str, where: str, dtype, compute) -> None:
    try:
        real = compute()
    except ValueError as err:
        raise CheckpointError(f"{where}: {base}weight: {err}") from err
    state[base + "weight"] = real.to(dtype) if dtype is not None else real
