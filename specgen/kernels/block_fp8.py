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
from .keyed_noise import tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                 # the largest finite e4m3fn value
BLOCK = 128                     # DeepSeek-V3's weight block and activation group
BLOCK_M = 32
BLOCK_N = 64


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


_jitted = False


def jit_kernels() -> None:
    global _jitted, _block_fp8_gemm_kernel
    if _jitted:
        return
    if triton is None:
        raise RuntimeError("triton is not installed")
    _block_fp8_gemm_kernel = triton.jit(_block_fp8_gemm_kernel)
    _jitted = True


if kn.should_jit_at_import():
    jit_kernels()


def block_fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            block: int = BLOCK, block_m: int = BLOCK_M, block_n: int = BLOCK_N) -> torch.Tensor:
    """Guarded launch: activations quantised (PyTorch), then the block-scaled FP8 GEMM."""
    # x: [M, K]; weight: [N, K] fp8; weight_scale: [ceil(N/block), ceil(K/block)] -> [M, N] x.dtype
    if not _jitted:
        jit_kernels()
    M, K = x.shape
    N = weight.shape[0]
    KB = -(-K // block)
    assert weight.dtype == FP8 and weight.shape[1] == K and weight.stride(1) == 1, "weight: [N, K] e4m3fn"
    assert weight_scale.shape == (-(-N // block), KB) and weight_scale.dtype == torch.float32
    assert block % block_n == 0, "a tile of N must lie in one weight block"
    weight_scale = weight_scale.contiguous()
    x_fp8, x_scale = quantize_activations(x, block)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _block_fp8_gemm_kernel[grid](x_fp8, x_scale, weight, weight_scale, out, M, N, K, KB,
                                 x_fp8.stride(0), weight.stride(0), out.stride(0),
                                 BLOCK_K=block, BLOCK_M=block_m, BLOCK_N=block_n)
    return out


@torch.library.custom_op("specgen::block_fp8_linear", mutates_args=())
def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: int) -> torch.Tensor:
    """The kernel where FP8 tensor cores are (`fp8_gemm_supported`), the reference elsewhere; one
    opaque op to torch.compile either way."""
    if fp8_gemm_supported(x.device):
        return block_fp8_linear_triton(x, weight, weight_scale, block)
    return block_fp8_linear_reference(x, weight, weight_scale, block)


@block_fp8_linear.register_fake
def _(x, weight, weight_scale, block):
    return x.new_empty(x.shape[0], weight.shape[0])
