"""Eager bf16 matrix products of many rows, computed in float32 on CPUs without native bf16.

Contract: inside `float32_products()`, every CPU `linear` / `mm` / `addmm` / `bmm` / `baddbmm`
whose operands are all bfloat16 and whose left operand has at least `MIN_ROWS` rows runs on float32
copies of its operands and returns its result rounded to bfloat16; everything else runs as it
would. The result is the exact products (bf16 x bf16 is exact in fp32) summed in fp32 and rounded
once, what a bf16 GEMM with fp32 accumulation computes, up to the order of the sum. Where to use it: CPUs without
AVX512-BF16 or AMX (machine.cpu_has_bf16 False).

Why: specgen's compiled steps multiply bf16 on such CPUs with a kernel of their own
(kernels/cpu_bf16_dot.py), but the prefill stays eager on CPU (pipelines/compiled.py
`compiles_prefill`), and an eager bf16 GEMM there goes through oneDNN's emulation. Measured on 2
Intel Xeon Skylake-SP threads, `F.linear` of x [M, 576] by a 1536 x 576 weight (ms, fp32 / bf16 /
bf16 through this mode): M = 1 0.19 / 0.27 / 0.44; 8 0.34 / 0.71 / 0.59; 32 1.25 / 1.57 / 1.48;
256 3.5 / 11.4 / 4.2; 1024 13.7 / 47.1 / 15.7. A SmolLM2 prefill of 8 prompts x 32 tokens took
1.61 s in bf16 against 0.46 in fp32, and held-out ShareGPT prompts at 8 slots spent more time in
the prefill than in decoding. Converting a weight costs a pass over it, which a few rows do not
repay: below MIN_ROWS the product stays bf16 (the prefill's LM head reads one row per prompt).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

MIN_ROWS = 16

_aten = torch.ops.aten
# op -> the index of the operand whose rows decide; under inference mode `F.linear` arrives whole
# (its input [..., K]: every leading dimension is rows), the others are (batched) matrix products
_LINEAR = _aten.linear.default
_PRODUCTS = {_LINEAR: 0, _aten.mm.default: 0, _aten.bmm.default: 0, _aten.addmm.default: 1,
             _aten.baddbmm.default: 1}


class _Float32Products(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        operand = _PRODUCTS.get(func)
        if operand is not None and _worth_converting(args, operand, func is _LINEAR):
            wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*wide, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def _worth_converting(args, operand: int, linear: bool) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors):
        return False
    left = args[operand]
    rows = left.numel() // max(left.shape[-1], 1) if linear else left.shape[-2]
    return rows >= MIN_ROWS


def float32_products():
    """A context in which many-row CPU bf16 products run in float32 (the module's contract)."""
    return _Float32Products()
