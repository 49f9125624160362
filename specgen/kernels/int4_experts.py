"""Routed experts kept in packed INT4 (W4A16, Kimi K2.5's published format): the product over (token,
expert) pairs as a Triton kernel for GPUs, through torch's int4 kernel on CPUs, and a PyTorch reference.

Contract. A stack of E experts' weights [E, N, K] kept as the checkpoint publishes it (compressed-tensors
`pack-quantized`, symmetric, groups of g = 32 inputs):
  packed [E, N, K / 8] int32   eight 4-bit codes a word along K, lowest bits first, code = value + 8
  scale  [E, N, K / g]         bf16 (any float dtype is read), one per group of g inputs of a row
  real weight w[e, n, k] = (code - 8) x scale[e, n, k // g]
`int4_pairs(x [P, K], experts [P] int64, packed, scale, group)` -> [P, N] in x's dtype: row p is
x_p W_{experts[p]}^T. Activations go in as bf16 on every path (the weights' integers are exact in bf16;
the float32 activations path of torch's CPU kernel is 48x slower), and sums are accumulated in float32:
each group's integer codes times the activations, then times the group's scale. `int4_pairs_reference`
computes the same terms from dequantised weights in float32, so the kernels differ from it by the order
of float32 additions only (tests/test_int4_experts.py, against an unpacking of the format written
independently in NumPy).

By device:
- CUDA reads the published layout as it is (`_int4_grouped_kernel`): the pairs sorted by expert in
  blocks of BLOCK_M rows of one expert (`block_fp8.grouped_layout`, static shapes, no host sync), each
  program multiplying a block by one N tile of its expert's codes with `tl.dot`, group by group. One
  kernel at every batch size, because a row's sum never depends on the other rows of its block (an MMA
  computes each output element from its own row and column): a pair gets the same bits alone, beside
  others, in a plain step or a verify block, which spec == plain needs. An expert's weights are read
  once per block of its pairs (prefill and large batches), and a decode step's blocks hold one pair each.
- CPU repacks once at load (`cpu_layout`) into torch's CPU int4 pack (codes [E, N, K / 2] uint8 and
  [E, K / g, N, 2] bf16 (scale, zero = 0): symmetric maps onto it exactly) and multiplies each routed
  expert's pairs with `_weight_int4pack_mm_for_cpu`, one call per expert the step uses (the op is opaque
  to torch.compile; a CPU pays nothing for reading which experts were chosen). The kernel gives a row
  the same bits however many rows share its call (tests/test_int4_experts.py checks it).
"""

from __future__ import annotations

import torch

from . import keyed_noise as kn
from . import launch_configs
from . import block_fp8
from .block_fp8 import grouped_layout
from .keyed_noise import tl, triton

CODES_PER_WORD = 8


def unpack_codes(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """The 4-bit codes (0..15) of a packed [..., N, ceil(K / 8)] int32 tensor, as [..., N, K] int32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    # an arithmetic shift of a negative int32 fills high bits with ones; the mask drops them
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF                       # [..., N, K / 8, 8]
    return nibbles.flatten(-2)[..., :columns]


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """`unpack_codes`' inverse: codes [..., N, K] in 0..15 (K a multiple of 8) -> [..., N, K / 8] int32."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (codes.to(torch.int64).unflatten(-1, (-1, CODES_PER_WORD)) << shifts).sum(dim=-1)   # < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def quantize_symmetric(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense weights [..., N, K] -> the published layout (words [..., N, K / 8] int32, bf16 scales
    [..., N, K / g]): each group's scale absmax / 7 rounded to bf16 first, the codes chosen against it
    (round(w / scale) in -8..7, stored + 8), as a symmetric pack-quantized checkpoint holds them."""
    grouped = weight.to(torch.float32).unflatten(-1, (-1, group))
    scale = (grouped.abs().amax(dim=-1) / 7).to(torch.bfloat16)
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = torch.clamp(torch.round(grouped / safe.unsqueeze(-1)), -8, 7) + 8
    return pack_codes(codes.flatten(-2)), scale


def dequantize(packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """Real weights, float32: [..., N, K / 8] int32 and [..., N, K / g] -> [..., N, K]."""
    columns = packed.shape[-1] * CODES_PER_WORD
    codes = unpack_codes(packed, columns).to(torch.float32) - 8
    return codes * scale.to(torch.float32).repeat_interleave(group, dim=-1)[..., :columns]


def int4_pairs_reference(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                         group: int) -> torch.Tensor:
    """Each pair's bf16 row times its expert's dequantised weights, in float32."""
    # x: [P, K]; experts: [P]; packed: [E, N, K / 8] int32; scale: [E, N, K / g] -> [P, N] x.dtype
    w = dequantize(packed[experts], scale[experts], group)                          # [P, N, K]
    rows = x.to(torch.bfloat16).to(torch.float32).unsqueeze(-1)
    return torch.bmm(w, rows).squeeze(-1).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# CPU: torch's int4 pack
# ---------------------------------------------------------------------------------------------------


def torch_int4_pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] in 0..15 with a (scale, zero) per group [N, K / g] -> torch's CPU int4 pack: codes
    [N, K / 2] uint8 (its own interleaved layout) and pairs [K / g, N, 2] bf16, w = (code - 8) x scale + zero."""
    pairs = torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1), pairs


def cpu_layout(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The published layout repacked for torch's CPU int4 kernel, expert by expert (no float round trip:
    the codes move as they are, the bf16 scales stay bf16, the zero is 0)."""
    # packed: [E, N, K / 8] int32; scale: [E, N, K / g] -> ([E, N, K / 2] uint8, [E, K / g, N, 2] bf16)
    columns = packed.shape[-1] * CODES_PER_WORD
    experts = [torch_int4_pack(unpack_codes(p, columns), s, torch.zeros_like(s)) for p, s in zip(packed, scale)]
    return torch.stack([codes for codes, _ in experts]), torch.stack([pairs for _, pairs in experts])


def int4_pairs_cpu(x: torch.Tensor, experts: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor,
                   group: int) -> torch.Tensor:
    """The pairs through torch's CPU kernel, one call per routed expert (`cpu_layout`'s tensors)."""
    # x: [P, K]; experts: [P]; codes: [E, N, K / 2] uint8; pairs: [E, K / g, N, 2] -> [P, N] x.dtype
    rows = x.to(torch.bfloat16)
    out = torch.empty(x.shape[0], codes.shape[1], dtype=torch.bfloat16)
    for expert in torch.unique(experts).tolist():
        mine = (experts == expert).nonzero().squeeze(1)
        out[mine] = torch.ops.aten._weight_int4pack_mm_for_cpu(rows[mine], codes[expert], group, pairs[expert])
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Triton kernel (a plain function, jitted on first use: see keyed_noise's docstring for why)
# ---------------------------------------------------------------------------------------------------


def _int4_grouped_kernel(x_ptr, rows_ptr, block_expert_ptr, w_ptr, s_ptr, out_ptr, N, K, KG,
                         stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                         GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         FLOAT32_DOT: tl.constexpr):
    # program (block of BLOCK_M pairs of one expert, N tile): rows_ptr holds the pairs of each expert in
    # blocks of BLOCK_M (-1 = padding), block_expert_ptr each block's expert (-1 = an unused block).
    # Each group of GROUP inputs: codes - 8 (exact in bf16) dotted with the bf16 activations in float32,
    # then scaled by the group's scale per column.
    pid_n = tl.program_id(1)
    expert, rows, valid = block_fp8._block_of_pairs(rows_ptr, block_expert_ptr, tl.program_id(0), BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, GROUP)
    e = tl.maximum(expert, 0).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.where(expert >= 0, KG, 0)):          # an unused block reads nothing
        k = g * GROUP + ks
        a = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                    other=0.0)
        words = tl.load(w_ptr + e * stride_we + cols[None, :] * stride_wn + (k // 8)[:, None],
                        mask=(cols[None, :] < N) & (k[:, None] < K), other=0)
        codes = ((words >> ((k % 8) * 4)[:, None]) & 0xF) - 8                 # [GROUP, BLOCK_N]
        if FLOAT32_DOT:
            # Triton's interpreter (3.9) multiplies bf16 operands as raw bits: the same exact terms
            # (a bf16 value times a 4-bit integer) summed in float32, from float32 operands
            part = tl.dot(a.to(tl.float32), codes.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, codes.to(tl.bfloat16), out_dtype=tl.float32)
        s = tl.load(s_ptr + e * stride_se + cols * stride_sn + g, mask=cols < N, other=0.0).to(tl.float32)
        acc += part * s[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


_jitted = False


def jit_kernels() -> None:
    global _jitted, _int4_grouped_kernel
    if _jitted:
        return
    if triton is None:
        raise RuntimeError("triton is not installed")
    block_fp8.jit_kernels()          # its `_block_of_pairs`, which the kernel calls
    _int4_grouped_kernel = triton.jit(_int4_grouped_kernel)
    _jitted = True


if kn.should_jit_at_import():
    jit_kernels()


def int4_kernel_supported(device: torch.device) -> bool:
    """Where the Triton kernel runs: CUDA devices with Triton (bf16 tensor cores: Ampere and up)."""
    return (device.type == "cuda" and triton is not None and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def int4_pairs_triton(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                      group: int) -> torch.Tensor:
    """Guarded launch of the grouped kernel over expert-sorted pairs (see the module docstring)."""
    # x: [P, K]; experts: [P] int64; packed: [E, N, K / 8] int32; scale: [E, N, K / g] -> [P, N] x.dtype
    if not _jitted:
        jit_kernels()
    P, K = x.shape
    E, N = packed.shape[:2]
    assert packed.dtype == torch.int32 and packed.shape[2] * CODES_PER_WORD == K and packed.stride(2) == 1, \
        "packed: [E, N, K / 8] int32"
    assert scale.shape == (E, N, K // group) and K % group == 0 and group % 16 == 0, "scale: [E, N, K / group]"
    assert scale.stride(2) == 1, "scale: contiguous along K"
    assert experts.shape == (P,) and experts.dtype == torch.int64
    launch = launch_configs.INT4_GROUPED
    block_m, block_n = launch.tiles["BLOCK_M"], launch.tiles["BLOCK_N"]
    rows = x.to(torch.bfloat16).contiguous()
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0 or N == 0:
        return out
    order, block_expert = grouped_layout(experts.contiguous(), E, block_m)
    _int4_grouped_kernel[(block_expert.shape[0], triton.cdiv(N, block_n))](
        rows, order, block_expert, packed, scale, out, N, K, K // group,
        rows.stride(0), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, FLOAT32_DOT=kn.interpreting(), num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return out


@torch.library.custom_op("specgen::int4_pairs", mutates_args=())
def int4_pairs(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               group: int) -> torch.Tensor:
    """By the weights' layout and device: torch's CPU pack (uint8 codes, `cpu_layout`), the Triton
    kernel on the published layout where it runs (`int4_kernel_supported`), else the reference; one
    opaque op to torch.compile."""
    if packed.dtype == torch.uint8:
        return int4_pairs_cpu(x, experts, packed, scale, group)
    if int4_kernel_supported(x.device):
        return int4_pairs_triton(x, experts, packed, scale, group)
    return int4_pairs_reference(x, experts, packed, scale, group)


@int4_pairs.register_fake
def _(x, experts, packed, scale, group):
    return x.new_empty(x.shape[0], packed.shape[1])
