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
`Linear` under `module` for one; `QuantizedEmbedding` keeps an embedding as 8-bit codes.
`quantize_target` does a whole decoder target, keeping a GGUF's own 4-bit blocks as they are
(checkpoints/gguf_blocks.py) rather than quantizing their dequantised values again. A quantized target is a different model from the bf16 one; what
specgen promises for it is that speculative output equals plain decoding's with the same quantized
weights (the products give each row the same bits alone as beside others: tests/test_quantized_linear.py).
CPU only for now (eager, or compiled: Inductor calls the same kernels inside the step's graph); a GPU's
W4A16 kernel is issue 71's next part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specgen.kernels.int4_experts import torch_int4_pack

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
    packed, pairs = torch_int4_pack(codes, scales, zeros)
    return QuantizedWeight("int4", packed, pairs, tuple(codes.shape), group)


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


def packs_int4(rows: int) -> bool:
    """Whether torch's CPU int4 pack takes a weight of `rows` output rows (multiples of 16 only); a
    product it does not take stays dense."""
    return rows % 16 == 0


def quantizes(shape, kind: str, group: int = INT4_GROUP) -> bool:
    """Whether a dense [N, K] weight goes into `kind`: int8 always; int4 where K fills whole groups
    and torch's pack takes N rows (a small projection that does not, MLA's q_b_proj at a tiny rank,
    stays dense)."""
    n, k = shape
    return kind == "int8" or (k % group == 0 and packs_int4(n))


def quantize(weight: torch.Tensor, kind: str, group: int = INT4_GROUP) -> QuantizedWeight:
    if kind == "int4":
        return quantize_int4(weight, group)
    if kind == "int8":
        return quantize_int8(weight)
    raise ValueError(f"quantization {kind!r}: expected one of {', '.join(KINDS)}")


class QuantizedEmbedding(nn.Module):
    """An embedding kept as 8-bit (or 4-bit, from a GGUF's 4-bit blocks) integer codes with a float32
    scale and offset per 32 columns of a row: row = codes x scale + offset, computed per looked-up row
    in float32, then in the run's dtype. A GGUF's Q8_0 / Q4_x embedding keeps its own blocks (exact
    but for Q4_1's offsets, rounded to float32); a dense one is quantized symmetric, absmax / 127 per
    32 columns (`quantize_embedding`). `weight` builds the dense table: only what reads the matrix
    itself asks for it (`DecoderTarget.embedding_dtype` answers the dtype without it)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        # codes: [V, H] int8; scales, offsets: [V, H / 32] float32
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.to(torch.float32).contiguous())
        self.register_buffer("offsets", offsets.to(torch.float32).contiguous())
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = codes.shape

    @property
    def weight(self) -> torch.Tensor:
        """The dense embedding [V, H] in the run's dtype, computed on each call (a draft that converts
        the target's embedding reads it once, at load)."""
        return self._rows(self.codes, self.scales, self.offsets)

    def _rows(self, codes, scales, offsets) -> torch.Tensor:
        # codes: [..., H]; scales, offsets: [..., H / 32] -> [..., H] in the run's dtype
        grouped = codes.float().unflatten(-1, (-1, INT4_GROUP))
        return (grouped * scales.unsqueeze(-1) + offsets.unsqueeze(-1)).flatten(-2).to(self.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: [...] -> [..., H]
        return self._rows(self.codes[tokens], self.scales[tokens], self.offsets[tokens])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))


def quantize_embedding(weight: torch.Tensor) -> QuantizedEmbedding:
    # weight: [V, H] -> int8 codes, one float32 scale per 32 columns of a row (symmetric, absmax / 127)
    v, h = weight.shape
    grouped = weight.to(torch.float32).view(v, h // INT4_GROUP, INT4_GROUP)
    scales = grouped.abs().amax(dim=-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.clamp(torch.round(grouped / safe[..., None]), -127, 127).view(v, h)
    return QuantizedEmbedding(codes, scales, torch.zeros_like(scales), weight.dtype)


class QuantizedOnly(RuntimeError):
    """A dense weight asked of a layer that keeps its weight quantized only."""


class QuantizedLinear(nn.Module):
    """A `Linear` whose weight is kept quantized; `dense` keeps the original weight beside it where
    something else reads it (a draft that shares the target's head)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 dense: torch.Tensor | None = None) -> None:
        super().__init__()
        self.quantized = weight
        self.bias = bias
        self.dense = dense
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, where it is kept (the head beside a draft that shares it)."""
        if self.dense is None:
            raise QuantizedOnly("this layer keeps its weight quantized only (a target quantized for a draft "
                                "that reads its head keeps it dense beside: quantize_target's keep_dense_head)")
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


# Our fused projections and the checkpoint tensors whose rows they stack, in order
FUSED_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def published_weight(blocks: list, kind: str | None) -> QuantizedWeight | None:
    """A product's weight from a GGUF's own blocks (checkpoints/gguf_blocks.py; `blocks`: the
    checkpoint tensors its rows stack), or None where they are not all there. 4-bit blocks move into
    torch's int4 pack as they are (codes exact; each block's scale and offset rounded to bf16, the
    pair torch's kernel takes); 8-bit ones become int8 with a scale per row (torch's int8 kernel has
    no per-block scales), quantized again from their exact values: the one place where `auto` on a
    GGUF quantizes again (a Q8_0 weight in int8 per row: half a step of its row's largest value)."""
    if not blocks or any(b is None for b in blocks):
        return None
    if all(b.bits == 4 for b in blocks):
        if not packs_int4(sum(b.codes.shape[0] for b in blocks)):
            return None                    # torch's pack does not take it: the layer stays dense
        cat = lambda field: torch.cat([getattr(b, field) for b in blocks])      # noqa: E731
        return packed_int4(cat("codes"), cat("scales"), cat("offsets"), INT4_GROUP)
    # 8-bit blocks (or 8 beside 4): int8 with a scale per row, quantized again from the exact values
    return quantize_int8(torch.cat([b.dequantized() for b in blocks]).to(torch.float32))


def quantize_target(model: nn.Module, kind: str | None, group: int = INT4_GROUP, published: dict | None = None,
                    keep_dense_head: bool = False) -> None:
    """A decoder target's layers' products, its LM head and its embedding kept quantized
    (models/decoder.py). `kind`: what a dense weight becomes ("int4" / "int8"; None: it stays dense).
    A MoE's routed experts become the published INT4 layout under "int4" (models/moe.py
    `quantize_int4`; under "int8" they stay dense: no int8 expert product yet); weights the model reads
    as matrices rather than multiplies by (`FP8_DEQUANTIZED`: MLA's kv_b_proj) stay dense.
    `published`: a GGUF's own blocks by checkpoint name (checkpoints/gguf_blocks.published_blocks,
    decoded one weight at a time), kept in place of quantizing their dequantised values again
    (`published_weight`: 4-bit blocks as they are; 8-bit ones int8 per row). The embedding
    becomes 8-bit codes with a scale per 32 columns (a GGUF's own blocks where it has them). The head
    keeps a dense copy beside only with `keep_dense_head` (a draft that shares the target's head:
    MTP, DFlash)."""
    published = published or {}
    read_as_matrices = getattr(model, "FP8_DEQUANTIZED", ())     # MLA's kv_b_proj: absorbed, never multiplied
    for i, layer in enumerate(model.model.layers):
        for path, module in list(layer.named_modules()):
            if hasattr(module, "quantize_int4"):          # MoE routed experts (models/moe.py)
                if kind == "int4" and module.int4_group is None and module.fp8_block is None and all(
                        quantizes(w.shape[1:], kind, group) for w in (module.gate_up_proj, module.down_proj)):
                    module.quantize_int4(group)
                continue
            if not isinstance(module, nn.Linear) or path.endswith(read_as_matrices):
                continue
            parts = FUSED_PARTS.get(path, (path,))
            weight = published_weight([published.get(f"model.layers.{i}.{p}.weight") for p in parts], kind)
            if weight is None and (kind is None or not quantizes(module.weight.shape, kind, group)):
                continue
            weight = weight or quantize(module.weight.detach(), kind, group)
            parent, _, name = path.rpartition(".")
            setattr(layer.get_submodule(parent) if parent else layer, name, QuantizedLinear(weight, module.bias))
    head, embedding = model.lm_head.weight.detach(), model.model.embed_tokens.weight.detach()
    tied = head.data_ptr() == embedding.data_ptr()
    embedding_blocks = published.get("model.embed_tokens.weight")          # decoded once, for both
    head_blocks = embedding_blocks if tied else published.get("lm_head.weight")
    weight = published_weight([head_blocks], kind) if head_blocks is not None else None
    if weight is None and kind is not None and quantizes(head.shape, kind, group):
        weight = quantize(head, kind, group)
    if weight is not None:
        model.lm_head = QuantizedLinear(weight, dense=head if keep_dense_head else None)
    if embedding_blocks is not None:
        codes = embedding_blocks.codes.to(torch.int16) - 8
        model.model.embed_tokens = QuantizedEmbedding(codes, embedding_blocks.scales, embedding_blocks.offsets,
                                                      embedding.dtype)
    elif kind is not None:
        model.model.embed_tokens = quantize_embedding(embedding)
