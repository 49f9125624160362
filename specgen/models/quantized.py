"""Weights kept quantized (weight-only int8 / int4) and the products that read them as they are.

Contract: `quantize_int4(weight, group)` / `quantize_int8(weight)` -> a `QuantizedWeight` holding what
the product reads: int4 as torch's CPU pack of 4-bit codes with one bf16 (scale, zero) pair per
`group` input columns of a row, w = (code - 8) x scale + zero; a dense weight is quantized affine
(each group's min..max over the 16 codes: `int4_affine_codes`), and the symmetric form (zero = 0,
code = round(w / scale) + 8: `int4_codes`, the layout Kimi K2.5's checkpoints publish their experts
in, compressed-tensors `pack-quantized`) is what a published symmetric checkpoint packs into; int8
as one code per weight and one scale per output row. `weight.matmul(x)` is x @ W_q^T computed from
the codes (torch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm`: weight-only kernels that
read a quarter / half of bf16's bytes); `weight.dequantized()` is W_q itself, dense, for references.
`QuantizedLinear` stands in for a `Linear`; `quantize_linears(module, kind, group)` swaps every
`Linear` under `module` for one. A quantized target is a different model from the bf16 one; what
specgen promises for it is that speculative output equals plain decoding's with the same quantized
weights (the products give each row the same bits alone as beside others: tests/test_quantized_linear.py).
CPU only for now (eager, or compiled: Inductor calls the same kernels inside the step's graph); a GPU's
W4A16 kernel is issue 71's next part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

KINDS = ("int8", "int4")
INT4_GROUP = 32


@dataclass
class QuantizedWeight:
    kind: str                        # "int8" | "int4"
    codes: torch.Tensor              # int4: torch's CPU pack [N, K / 2] uint8; int8: [N, K] int8
    scales: torch.Tensor             # int4: [K / group, N, 2] (scale, zero); int8: [N]
    shape: tuple[int, int]           # (N, K): the dense weight's
    group: int = INT4_GROUP          # int4: input columns per scale

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N], x's dtype. The activations go in as bf16 whatever x's dtype: torch's
        # kernels take float32 ones on a slow path (the SmolLM2 head at one row: 19.9 ms in float32,
        # 0.41 ms in bf16, 2 AMD EPYC Zen 5 cores); they accumulate in float32 either way
        flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        if self.kind == "int4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.codes, self.group, self.scales)
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scales)
        return out.view(*x.shape[:-1], self.shape[0]).to(x.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W_q, dense [N, K]: the weights the product multiplies by (exactly, in float32)."""
        n, k = self.shape
        if self.kind == "int8":
            return self.codes.to(torch.float32) * self.scales.to(torch.float32)[:, None]
        eye = torch.eye(k, dtype=torch.float32)
        # the kernel itself reads the pack (float32 in and out: exact): the identity's product is W_q^T
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.codes, self.group,
                                                           self.scales.to(torch.float32)).t().to(dtype)

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def int4_codes(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group-wise 4-bit codes of `weight` [N, K]: (codes [N, K] int32 in 0..15 = value + 8,
    scales [N, K / group] float32), value = clamp(round(w / scale), -8, 7), scale = absmax / 7 per group
    (0 where the group is all zero: its codes are then 8, value 0)."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4 weights: {k} input columns are not a multiple of the group size {group}")
    grouped = weight.to(torch.float32).view(n, k // group, group)
    scales = grouped.abs().amax(dim=-1) / 7
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    values = torch.clamp(torch.round(grouped / safe[..., None]), -8, 7)
    return (values + 8).to(torch.int32).view(n, k), scales


def int4_affine_codes(weight: torch.Tensor, group: int = INT4_GROUP
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Affine group-wise 4-bit codes of `weight` [N, K]: (codes [N, K] int32 in 0..15, scales and zeros
    [N, K / group] float32, bf16-representable) with w ~ (code - 8) x scale + zero: each group's 16
    levels span its min..max (the scale and zero rounded to bf16 first, then the codes chosen against
    them, so the rounding costs no accuracy twice). Where a group is constant its scale is 0."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"int4 weights: {k} input columns are not a multiple of the group size {group}")
    grouped = weight.to(torch.float32).view(n, k // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / 15).to(torch.bfloat16).to(torch.float32)
    zeros = (low + 8 * scales).to(torch.bfloat16).to(torch.float32)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.clamp(torch.round((grouped - zeros[..., None]) / safe[..., None]) + 8, 0, 15)
    return codes.to(torch.int32).view(n, k), scales, zeros


def packed_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> QuantizedWeight:
    """Codes [N, K] in 0..15 and (scale, zero) [N, K / group] -> torch's CPU int4 pack."""
    n, k = codes.shape
    pairs = torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()   # [K/g, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    return QuantizedWeight("int4", packed, pairs, (n, k), group)


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP, symmetric: bool = False) -> QuantizedWeight:
    # weight: [N, K] -> codes packed for torch's CPU int4 product, bf16 (scale, zero) per group
    if symmetric:
        codes, scales = int4_codes(weight, group)
        return packed_int4(codes, scales, torch.zeros_like(scales), group)
    return packed_int4(*int4_affine_codes(weight, group), group)


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    # weight: [N, K] -> int8 codes, one bf16 scale per output row (symmetric, absmax / 127)
    w = weight.to(torch.float32)
    scales = (w.abs().amax(dim=1) / 127).to(torch.bfloat16)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).to(torch.float32)
    codes = torch.clamp(torch.round(w / safe[:, None]), -127, 127).to(torch.int8)
    return QuantizedWeight("int8", codes.contiguous(), scales, tuple(weight.shape))


def quantize(weight: torch.Tensor, kind: str, group: int = INT4_GROUP) -> QuantizedWeight:
    if kind == "int4":
        return quantize_int4(weight, group)
    if kind == "int8":
        return quantize_int8(weight)
    raise ValueError(f"quantization {kind!r}: expected one of {', '.join(KINDS)}")


class QuantizedLinear(nn.Module):
    """A `Linear` whose weight is kept quantized; `dense` keeps the original weight beside it where
    something else reads it (a tied embedding, a draft that shares the target's head)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None) -> None:
        super().__init__()
        self.quantized = weight
        self.bias = bias
        self.dense = dense
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, where it is kept (the head: drafts and tied embeddings read it)."""
        if self.dense is None:
            raise AttributeError("this layer keeps its weight quantized only")
        return self.dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quantized.matmul(x)
        return out if self.bias is None else out + self.bias


def quantize_linears(module: nn.Module, kind: str, group: int = INT4_GROUP) -> int:
    """Swap every `Linear` (an nn.Linear) under `module` for a QuantizedLinear; returns how many."""
    swapped = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, QuantizedLinear(quantize(child.weight.detach(), kind, group), child.bias))
            swapped += 1
        else:
            swapped += quantize_linears(child, kind, group)
    return swapped


def quantize_target(model: nn.Module, kind: str, group: int = INT4_GROUP) -> None:
    """A decoder target's layers' products and its LM head kept quantized (models/decoder.py). The
    head keeps its dense weight beside (`output_embedding`: drafts that share the target's head read
    it; a tied embedding is the same tensor); embeddings stay dense (a lookup reads one row a token)."""
    quantize_linears(model.model.layers, kind, group)
    head = model.lm_head.weight.detach()
    model.lm_head = QuantizedLinear(quantize(head, kind, group), dense=head)
