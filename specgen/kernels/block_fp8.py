"""Block-scaled FP8 GEMM (DeepSeek-V3's weight format): Triton kernel, wrapper, PyTorch reference.

Contract. A linear layer y = x W^T with W kept in FP8:
  weight        [N, K]                float8_e4m3fn
  weight_scale  [ceil(N/BW), ceil(K/BW)] float32  the multiplier back to real values of each BW x BW
                                      block (DeepSeek's `weight_scale_inv`; BW = 128 in every
                                      DeepSeek-V3 checkpoint)
  x             [M, K]                float32 / bfloat16 / float16 activations
`quantize_activations(x, group)` gives x as FP8 in 1 x group slices along K (`x_fp8 [M, K]`, `x_scale
[M, ceil(K/group)]` float32 = amax / 448 of each slice, DeepSeek's `act_quant`), and
`block_fp8_linear(x, weight, weight_scale, block)` = sum over K blocks of
(x_fp8 . W_fp8 over the block) x x_scale x weight_scale, accumulated in float32, returned in x's
dtype. `block_fp8_linear_reference` is the same sum in PyTorch (the CPU path and the test oracle);
`dequantized_linear` is x W^T with W dequantised, which the FP8 path approaches within the
activations' FP8 rounding (3 mantissa bits: about 2^-4 of each slice's largest value).

Routed experts (`block_fp8_pairs`): P (token, expert) pairs, `x [P, K]` and `experts [P]` int64 into
a stack `weight [E, N, K]` FP8 with `weight_scale [E, ceil(N/BW), ceil(K/BW)]`: row p is x_p W_e^T
with e = experts[p], the same block-scaled sum. Two kernels, on the devices the GEMM takes: one
matrix-vector product per pair (weights read per pair: decode-sized steps, where few pairs share an
expert), and from GROUPED_MIN_PAIRS pairs on a grouped GEMM over the pairs sorted by expert in blocks
of one expert each (`grouped_layout`, static shapes), which reads an expert's weights once per block
of its pairs (prefill, large batches). The reference gathers and dequantises the pairs' experts.

On CUDA, `block_fp8_linear` takes torch's own blockwise `F.scaled_mm` (1 x 128 activation scales,
128 x 128 weight scales: cuBLAS on Hopper) where this torch and GPU run it and it agrees with the
reference on a probe problem (`scaled_mm_works`, once per device); else the Triton kernel below.

The kernel tiles N by BLOCK_N <= BW (each tile reads one weight scale a K block) and steps K by the
block itself, so each product of FP8 tiles is scaled once by its two scales, as DeepSeek's reference
`fp8_gemm` does. It needs FP8 tensor cores on CUDA (compute capability 8.9+: Ada, Hopper, Blackwell);
`fp8_gemm_supported(device)` says where, and elsewhere weights are dequantised on load instead
(checkpoints/quantized.py). Kernel and reference take the same FP8 inputs; their sums differ by the
order of float32 additions only.
"""

from __future__ import annotations

import torch

from . import keyed_noise as kn
from . import launch_configs
from .keyed_noise import tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # the largest finite e4m3fn value
BLOCK = 128                     # DeepSeek-V3's weight block and activation group
GROUPED_MIN_PAIRS = 1024        # (token, expert) pairs from which routed experts take the grouped GEMM


def fp8_gemm_supported(device: torch.device) -> bool:
    """FP8 tensor cores and Triton: CUDA devices of compute capability 8.9 and up."""
    return (device.type == "cuda" and triton is not None and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 9))


def quantize_activations(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x in FP8, each 1 x group slice of a row scaled by its own amax / 448."""
    # x: [M, K] -> (x_fp8 [M, K] e4m3fn, x_scale [M, ceil(K / group)] f32)
    M, K = x.shape
    groups = -(-K // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - K)).view(M, groups, group)
    scale = padded.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    quantized = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.view(M, groups * group)[:, :K].contiguous(), scale


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    # weight: [N, K] fp8; weight_scale: [ceil(N/block), ceil(K/block)] -> [N, K] f32
    N, K = weight.shape
    scale = weight_scale.repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return weight.float() * scale


def block_fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                               block: int = BLOCK) -> torch.Tensor:
    """The kernel's sum in PyTorch: activations quantised in 1 x block slices, products per K block."""
    # x: [M, K]; weight: [N, K] fp8; weight_scale: [ceil(N/block), ceil(K/block)] -> [M, N] x.dtype
    x_fp8, x_scale = quantize_activations(x, block)
    x_real = x_fp8.float() * x_scale.repeat_interleave(block, 1)[:, :x.shape[1]]
    return (x_real @ dequantize_weight(weight, weight_scale, block).T).to(x.dtype)


def block_fp8_pairs_reference(x: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor,
                              weight_scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Each pair's row times its expert's dequantised weight, activations quantised as above."""
    # x: [P, K]; experts: [P]; weight: [E, N, K] fp8; weight_scale: [E, nb, kb] -> [P, N] x.dtype
    x_fp8, x_scale = quantize_activations(x, block)
    x_real = x_fp8.float() * x_scale.repeat_interleave(block, 1)[:, :x.shape[1]]
    N, K = weight.shape[1:]
    scale = weight_scale[experts].repeat_interleave(block, 1)[:, :N].repeat_interleave(block, 2)[:, :, :K]
    w = weight[experts].float() * scale                                              # [P, N, K]
    return torch.bmm(w, x_real.unsqueeze(-1)).squeeze(-1).to(x.dtype)


def dequantized_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: int = BLOCK) -> torch.Tensor:
    """x W^T with W dequantised and x as it is (what a dequantised checkpoint computes)."""
    return (x.float() @ dequantize_weight(weight, weight_scale, block).T).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# Triton kernel (a plain function, jitted on first use: see keyed_noise's docstring for why)
# ---------------------------------------------------------------------------------------------------


def _block_fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, KB,
                           stride_xm, stride_wn, stride_om,
                           BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # every column of this tile lies in one weight block row (BLOCK_N divides BLOCK_K)
    w_block_row = (pid_n * BLOCK_N) // BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        k = kb * BLOCK_K + ks
        a = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :],
                    mask=(rows[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(w_ptr + cols[None, :] * stride_wn + k[:, None],
                    mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)
        a_scale = tl.load(xs_ptr + rows * KB + kb, mask=rows < M, other=0.0)
        b_scale = tl.load(ws_ptr + w_block_row * KB + kb)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def _block_fp8_pairs_kernel(x_ptr, xs_ptr, e_ptr, w_ptr, ws_ptr, out_ptr, N, K, KB, NB,
                            stride_xm, stride_we, stride_wn, stride_om,
                            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(e_ptr + pair)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_block_row = (pid_n * BLOCK_N) // BLOCK_K
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for kb in range(0, KB):
        k = kb * BLOCK_K + ks
        a = tl.load(x_ptr + pair * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + expert * stride_we + cols[:, None] * stride_wn + k[None, :],
                    mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0).to(tl.float32)
        a_scale = tl.load(xs_ptr + pair * KB + kb)
        b_scale = tl.load(ws_ptr + (expert * NB + w_block_row) * KB + kb)
        acc += tl.sum(b * a[None, :], axis=1) * (a_scale * b_scale)
    tl.store(out_ptr + pair * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


def _block_of_pairs(rows_ptr, block_expert_ptr, pid_m, BLOCK_M: tl.constexpr):
    # block pid_m of `grouped_layout` -> (its expert, -1 for an unused block; its pairs' rows [BLOCK_M]
    # int64, 0 where padding; which rows are pairs). Shared by the grouped kernels (int4_experts.py too).
    expert = tl.load(block_expert_ptr + pid_m)
    rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows >= 0
    return expert, tl.where(valid, rows, 0).to(tl.int64), valid


def _block_fp8_grouped_kernel(x_ptr, xs_ptr, rows_ptr, block_expert_ptr, w_ptr, ws_ptr, out_ptr,
                              N, K, KB, NB, stride_xm, stride_we, stride_wn, stride_om,
                              BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              DOT_K: tl.constexpr):
    # program (block of BLOCK_M pairs of one expert, N tile): rows_ptr holds the pairs of each expert
    # in blocks of BLOCK_M (-1 = padding), block_expert_ptr each block's expert (-1 = unused block).
    # Each scale block of K is multiplied DOT_K columns at a time (smaller tiles in registers), its
    # products summed, then scaled once by the block's two scales.
    pid_n = tl.program_id(1)
    expert, rows, valid = _block_of_pairs(rows_ptr, block_expert_ptr, tl.program_id(0), BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, DOT_K)
    w_block_row = (pid_n * BLOCK_N) // BLOCK_K
    w_base = w_ptr + tl.maximum(expert, 0).to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.where(expert >= 0, KB, 0)):        # an unused block reads nothing
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for half in tl.static_range(BLOCK_K // DOT_K):
            k = kb * BLOCK_K + half * DOT_K + ks
            a = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=valid[:, None] & (k[None, :] < K),
                        other=0.0)
            b = tl.load(w_base + cols[None, :] * stride_wn + k[:, None],
                        mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)
            part += tl.dot(a, b)
        a_scale = tl.load(xs_ptr + rows * KB + kb, mask=valid, other=0.0)
        b_scale = tl.load(ws_ptr + (tl.maximum(expert, 0) * NB + w_block_row) * KB + kb)
        acc += part * a_scale[:, None] * b_scale
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols[None, :] < N))


_jitted = False


def jit_kernels() -> None:
    global _jitted, _block_fp8_gemm_kernel, _block_fp8_pairs_kernel, _block_fp8_grouped_kernel, _block_of_pairs
    if _jitted:
        return
    if triton is None:
        raise RuntimeError("triton is not installed")
    _block_of_pairs = triton.jit(_block_of_pairs)
    _block_fp8_gemm_kernel = triton.jit(_block_fp8_gemm_kernel)
    _block_fp8_pairs_kernel = triton.jit(_block_fp8_pairs_kernel)
    _block_fp8_grouped_kernel = triton.jit(_block_fp8_grouped_kernel)
    _jitted = True


if kn.should_jit_at_import():
    jit_kernels()


def block_fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            block: int = BLOCK) -> torch.Tensor:
    """Guarded launch: activations quantised (PyTorch), then the block-scaled FP8 GEMM."""
    # x: [M, K]; weight: [N, K] fp8; weight_scale: [ceil(N/block), ceil(K/block)] -> [M, N] x.dtype
    if not _jitted:
        jit_kernels()
    M, K = x.shape
    N = weight.shape[0]
    KB = -(-K // block)
    assert weight.dtype == FP8 and weight.shape[1] == K and weight.stride(1) == 1, "weight: [N, K] e4m3fn"
    assert weight_scale.shape == (-(-N // block), KB) and weight_scale.dtype == torch.float32
    launch = launch_configs.BLOCK_FP8_GEMM
    block_m, block_n = launch.tiles["BLOCK_M"], min(launch.tiles["BLOCK_N"], block)
    assert block % block_n == 0, "a tile of N must lie in one weight block"
    weight_scale = weight_scale.contiguous()
    x_fp8, x_scale = quantize_activations(x, block)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _block_fp8_gemm_kernel[grid](x_fp8, x_scale, weight, weight_scale, out, M, N, K, KB,
                                 x_fp8.stride(0), weight.stride(0), out.stride(0),
                                 BLOCK_K=block, BLOCK_M=block_m, BLOCK_N=block_n,
                                 num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out


def _expert_stack_shapes(x, experts, weight, weight_scale, block: int, block_n: int) -> tuple[int, ...]:
    """The routed-expert kernels' inputs checked (and the kernels jitted): (P, K, E, N, KB, NB)."""
    if not _jitted:
        jit_kernels()
    P, K = x.shape
    E, N = weight.shape[:2]
    KB, NB = -(-K // block), -(-N // block)
    assert weight.dtype == FP8 and weight.shape[2] == K and weight.stride(2) == 1, "weight: [E, N, K] e4m3fn"
    assert weight_scale.shape == (E, NB, KB) and weight_scale.dtype == torch.float32
    assert experts.shape == (P,) and experts.dtype == torch.int64 and block % block_n == 0
    return P, K, E, N, KB, NB


def block_fp8_pairs_triton(x: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor,
                           weight_scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Guarded launch: activations quantised (PyTorch), then one block-scaled product per pair."""
    # x: [P, K]; experts: [P] int64; weight: [E, N, K] fp8; weight_scale: [E, nb, kb] -> [P, N] x.dtype
    launch = launch_configs.BLOCK_FP8_PAIRS
    block_n = min(launch.tiles["BLOCK_N"], block)
    P, K, E, N, KB, NB = _expert_stack_shapes(x, experts, weight, weight_scale, block, block_n)
    weight_scale, experts = weight_scale.contiguous(), experts.contiguous()
    x_fp8, x_scale = quantize_activations(x, block)
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0 or N == 0:
        return out
    _block_fp8_pairs_kernel[(P, triton.cdiv(N, block_n))](
        x_fp8, x_scale, experts, weight, weight_scale, out, N, K, KB, NB,
        x_fp8.stride(0), weight.stride(0), weight.stride(1), out.stride(0), BLOCK_K=block, BLOCK_N=block_n,
        num_warps=launch.num_warps, num_stages=launch.num_stages)
    return out


def grouped_layout(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert in blocks of `block_m` rows of one expert each, with static shapes (no
    host sync: the step is one graph): (rows [blocks * block_m] pair index or -1, block_expert [blocks]
    expert or -1), blocks = ceil(P / block_m) + E, enough for every expert's last block to be partial."""
    # experts: [P] int64
    P = experts.shape[0]
    blocks = -(-P // block_m) + num_experts
    order = experts.argsort(stable=True)                              # pair ids, grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    counts = counts.scatter_add(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    sorted_experts = experts[order]
    slot = (padded_ends - padded)[sorted_experts] + torch.arange(P, device=experts.device) \
        - (counts.cumsum(0) - counts)[sorted_experts]
    rows = torch.full((blocks * block_m,), -1, dtype=torch.int64, device=experts.device)
    rows = rows.scatter(0, slot, order)
    starts = torch.arange(blocks, device=experts.device) * block_m
    block_expert = torch.searchsorted(padded_ends, starts, right=True)
    block_expert = torch.where(starts < padded_ends[-1], block_expert, -1)
    return rows, block_expert


def block_fp8_grouped_triton(x: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor,
                             weight_scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """`block_fp8_pairs`' contract through a grouped GEMM over expert-sorted pairs: each program
    multiplies a block of pairs of one expert by a tile of its weights, so an expert's weights are
    read once per block of pairs, not once per pair (prefill, large batches)."""
    # x: [P, K]; experts: [P]; weight: [E, N, K] e4m3fn; weight_scale: [E, NB, KB] -> [P, N]
    launch = launch_configs.BLOCK_FP8_GROUPED
    block_m, block_n = launch.tiles["BLOCK_M"], min(launch.tiles["BLOCK_N"], block)
    P, K, E, N, KB, NB = _expert_stack_shapes(x, experts, weight, weight_scale, block, block_n)
    assert block % min(launch.tiles["DOT_K"], block) == 0, "DOT_K must divide the scale block"
    weight_scale = weight_scale.contiguous()
    x_fp8, x_scale = quantize_activations(x, block)
    out = torch.empty(P, N, dtype=x.dtype, device=x.device)
    if P == 0 or N == 0:
        return out
    rows, block_expert = grouped_layout(experts.contiguous(), E, block_m)
    _block_fp8_grouped_kernel[(block_expert.shape[0], triton.cdiv(N, block_n))](
        x_fp8, x_scale, rows, block_expert, weight, weight_scale, out, N, K, KB, NB,
        x_fp8.stride(0), weight.stride(0), weight.stride(1), out.stride(0), BLOCK_K=block, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT_K=min(launch.tiles["DOT_K"], block), num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return out


def block_fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The same product through torch's blockwise `F.scaled_mm` (128-blocks only)."""
    # x: [M, K]; weight: [N, K] fp8; weight_scale: [ceil(N/128), ceil(K/128)] -> [M, N] x.dtype
    F = torch.nn.functional
    x_fp8, x_scale = quantize_activations(x, BLOCK)
    return F.scaled_mm(x_fp8, weight.t(), x_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                       weight_scale.t(), F.ScalingType.BlockWise128x128, output_dtype=x.dtype)


_SCALED_MM_WORKS: dict[str, bool] = {}


def scaled_mm_works(device: torch.device) -> bool:
    """Whether torch's blockwise `F.scaled_mm` runs on `device` and agrees with the reference, from
    one probe problem per device (its layouts and GPUs have changed between torch releases)."""
    if device.type == "cuda" and device.index is None:     # "cuda" at load, "cuda:0" at a step: one key
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key not in _SCALED_MM_WORKS and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the scaled_mm probe must run before a CUDA graph capture (load_target runs it)")
    if key not in _SCALED_MM_WORKS:
        ok = False
        if device.type == "cuda" and hasattr(torch.nn.functional, "ScalingType"):
            try:
                gen = torch.Generator().manual_seed(0)
                real = torch.randn(256, 512, generator=gen) * 0.05
                scale = real.view(2, 128, 4, 128).abs().amax(dim=(1, 3)) / FP8_MAX
                weight = (real.view(2, 128, 4, 128) / scale[:, None, :, None]).view(256, 512).to(FP8)
                x = torch.randn(32, 512, generator=gen).to(torch.bfloat16)
                args = [t.to(device) for t in (x, weight, scale)]
                got = block_fp8_linear_scaled_mm(*args).float().cpu()
                expected = block_fp8_linear_reference(x, weight, scale).float()
                ok = bool(((got - expected).norm() / expected.norm()) < 1e-2)
            except (RuntimeError, ValueError, TypeError, NotImplementedError):
                ok = False
        _SCALED_MM_WORKS[key] = ok
    return _SCALED_MM_WORKS[key]


@torch.library.custom_op("specgen::block_fp8_linear", mutates_args=())
def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int) -> torch.Tensor:
    """torch's blockwise scaled_mm or the Triton kernel where FP8 tensor cores are
    (`fp8_gemm_supported`), the reference elsewhere; one opaque op to torch.compile either way."""
    if fp8_gemm_supported(x.device):
        K, N = x.shape[1], weight.shape[0]
        # cuBLAS's blockwise layouts want whole 128-blocks of N and K in groups of 4 (as probed)
        if block == BLOCK and K % (4 * BLOCK) == 0 and N % BLOCK == 0 and scaled_mm_works(x.device):
            return block_fp8_linear_scaled_mm(x, weight, weight_scale)
        return block_fp8_linear_triton(x, weight, weight_scale, block)
    return block_fp8_linear_reference(x, weight, weight_scale, block)


@block_fp8_linear.register_fake
def _(x, weight, weight_scale, block):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("specgen::block_fp8_pairs", mutates_args=())
def block_fp8_pairs(x: torch.Tensor, experts: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    block: int) -> torch.Tensor:
    """The pairs' kernels where Triton loads FP8 (`fp8_gemm_supported`), the reference elsewhere; one
    opaque op to torch.compile. From GROUPED_MIN_PAIRS pairs on (a prefill chunk, a large batch) the
    grouped GEMM, which reads an expert's weights once per block of its pairs: per pair, a
    16,384-token prefill of DeepSeek-V3 reads about 3.9 TB a layer, grouped about 7.5 GB. Below it the
    per-pair product, whose one row per program suits decode steps where few pairs share an expert.
    The shapes are static, so each compiled step or graph takes one of them for good."""
    if fp8_gemm_supported(x.device):
        if x.shape[0] >= GROUPED_MIN_PAIRS:
            return block_fp8_grouped_triton(x, experts, weight, weight_scale, block)
        return block_fp8_pairs_triton(x, experts, weight, weight_scale, block)
    return block_fp8_pairs_reference(x, experts, weight, weight_scale, block)


@block_fp8_pairs.register_fake
def _(x, experts, weight, weight_scale, block):
    return x.new_empty(x.shape[0], weight.shape[1])
