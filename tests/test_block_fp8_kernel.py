"""The block-scaled FP8 GEMM: the kernel equals its PyTorch reference, and both approach the layer
with its weight dequantised within the activations' FP8 rounding.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py); on a machine
with CUDA every tensor is on the GPU, where the kernel compiles for real (FP8 tensor cores: compute
capability 8.9 and up, else the test is skipped there)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE

from specgen.kernels import block_fp8 as bf

needs_fp8 = pytest.mark.skipif(KERNEL_DEVICE.type == "cuda" and not bf.fp8_gemm_supported(KERNEL_DEVICE),
                               reason="this GPU has no FP8 tensor cores")


def layer(M, N, K, block=128, seed=0, dtype=torch.float32):
    """x [M, K] and a weight stored as DeepSeek stores it: FP8 [N, K] + a float32 scale per block."""
    gen = torch.Generator().manual_seed(seed)
    real = torch.randn(N, K, generator=gen) * 0.05
    blocks = torch.nn.functional.pad(real, (0, -K % block, 0, -N % block))
    blocks = blocks.view(-(-N // block), block, -(-K // block), block)
    scale = blocks.abs().amax(dim=(1, 3)) / bf.FP8_MAX
    weight = (blocks / scale[:, None, :, None]).to(bf.FP8).view(blocks.shape[0] * block, -1)[:N, :K]
    x = (torch.randn(M, K, generator=gen) * torch.linspace(0.1, 3, K)).to(dtype)
    return x, weight.contiguous(), scale.float()


def test_activations_are_quantised_per_slice_of_128_within_fp8_rounding():
    x, _, _ = layer(3, 8, 300)
    x[1, 130:140] = 100.0                       # one large slice does not coarsen the others
    q, scale = bf.quantize_activations(x)
    assert q.dtype == bf.FP8 and q.shape == x.shape and scale.shape == (3, 3)
    assert torch.allclose(scale[:, 0], x[:, :128].abs().amax(1) / 448)
    back = q.float() * scale.repeat_interleave(128, 1)[:, :300]
    error = (back - x).abs().view(3, -1)
    slices = torch.nn.functional.pad(x.abs(), (0, 84)).view(3, 3, 128).amax(-1).repeat_interleave(128, 1)[:, :300]
    assert (error <= slices / 16 + 1e-6).all()      # e4m3: 3 mantissa bits, half a step of the largest
    assert error[1, :128].max() < 0.2               # the first slice of row 1 kept its own scale


@needs_fp8
@pytest.mark.parametrize("M,N,K,dtype", [
    (1, 128, 128, torch.float32),        # one decode row, one block
    (5, 200, 300, torch.float32),        # N and K not multiples of the block (masked lanes, edge scales)
    (40, 256, 384, torch.bfloat16),      # more rows than a tile, bf16 activations
])
def test_kernel_equals_reference(M, N, K, dtype):
    x, weight, scale = layer(M, N, K, dtype=dtype)
    expected = bf.block_fp8_linear_reference(x, weight, scale)
    got = bf.block_fp8_linear_triton(*(t.to(KERNEL_DEVICE) for t in (x, weight, scale))).cpu()
    assert got.dtype == dtype and got.shape == (M, N)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol)
    # the kernel reads each tile's own weight scale: scaling one block row changes only its columns
    scale2 = scale.clone()
    scale2[0] *= 2
    changed = bf.block_fp8_linear_triton(*(t.to(KERNEL_DEVICE) for t in (x, weight, scale2))).cpu().float()
    torch.testing.assert_close(changed[:, :128], 2 * got.float()[:, :128], rtol=tol, atol=tol)
    torch.testing.assert_close(changed[:, 128:], got.float()[:, 128:], rtol=tol, atol=tol)


def test_the_fp8_product_approaches_the_dequantised_layer():
    x, weight, scale = layer(6, 256, 512)
    exact = bf.dequantized_linear(x, weight, scale)
    fp8 = bf.block_fp8_linear_reference(x, weight, scale)
    relative = (fp8 - exact).norm() / exact.norm()
    assert relative < 0.03                      # FP8 activations: a few percent, not more
    assert not torch.equal(fp8, exact)          # and it is a different product, not the same one


def test_the_op_takes_the_reference_where_there_are_no_fp8_tensor_cores():
    x, weight, scale = layer(2, 128, 256)
    assert not bf.fp8_gemm_supported(torch.device("cpu"))
    torch.testing.assert_close(torch.ops.specgen.block_fp8_linear(x, weight, scale, 128),
                               bf.block_fp8_linear_reference(x, weight, scale))


def experts_stack(E, N, K, block=128, seed=1):
    layers = [layer(1, N, K, block, seed=seed + e) for e in range(E)]
    return torch.stack([w for _, w, _ in layers]), torch.stack([s for _, _, s in layers])


@pytest.mark.parametrize("P,E,N,K,block", [(1, 2, 128, 128, 128), (7, 4, 200, 300, 128), (9, 3, 48, 40, 16)])
def test_the_pairs_kernel_equals_its_reference_and_reads_each_pairs_expert(P, E, N, K, block):
    weight, scale = experts_stack(E, N, K, block)
    x, _, _ = layer(P, N, K, block, seed=9)
    experts = torch.randint(0, E, (P,), generator=torch.Generator().manual_seed(2))
    expected = bf.block_fp8_pairs_reference(x, experts, weight, scale, block)
    got = bf.block_fp8_pairs_triton(*(t.to(KERNEL_DEVICE) for t in (x, experts, weight, scale)), block).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # row p is x_p times expert e's own layer
    for p in range(P):
        e = int(experts[p])
        one = bf.block_fp8_linear_reference(x[p:p + 1], weight[e], scale[e], block)
        torch.testing.assert_close(expected[p:p + 1], one, rtol=1e-5, atol=1e-5)


def test_torchs_blockwise_scaled_mm_is_probed_and_never_taken_off_cuda():
    assert bf.scaled_mm_works(torch.device("cpu")) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_the_op_equals_the_reference_at_deepseek_v3_shapes():
    # a 7168-wide input, as every DeepSeek-V3 projection out of the residual stream has
    x, weight, scale = layer(8, 1536, 7168, dtype=torch.bfloat16)
    expected = bf.block_fp8_linear_reference(x, weight, scale).float()
    got = torch.ops.specgen.block_fp8_linear(*(t.cuda() for t in (x, weight, scale)), 128).float().cpu()
    assert (got - expected).norm() / expected.norm() < 1e-2


@pytest.mark.parametrize("P,E,N,K,block", [(1, 2, 128, 128, 128), (45, 4, 200, 300, 128), (70, 6, 48, 40, 16)])
def test_the_grouped_kernel_equals_the_pairs_reference(P, E, N, K, block):
    """Pairs sorted by expert in blocks of one expert each (some experts unused, some blocks partial):
    the same rows as the per-pair reference, each pair's row in its own place."""
    weight, scale = experts_stack(E, N, K, block)
    x, _, _ = layer(P, N, K, block, seed=9)
    experts = torch.randint(0, E - 1, (P,), generator=torch.Generator().manual_seed(3))   # expert E-1 unused
    expected = bf.block_fp8_pairs_reference(x, experts, weight, scale, block)
    got = bf.block_fp8_grouped_triton(*(t.to(KERNEL_DEVICE) for t in (x, experts, weight, scale)), block).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_grouped_layout_puts_each_pair_once_in_blocks_of_its_expert():
    experts = torch.tensor([2, 0, 2, 2, 1, 0, 2, 2, 2])
    rows, block_expert = bf.grouped_layout(experts, 4, 4)
    assert rows.shape == ((9 + 3) // 4 * 4 + 4 * 4,) and block_expert.shape == (7,)
    assert sorted(r for r in rows.tolist() if r >= 0) == list(range(9))
    for b, e in enumerate(block_expert.tolist()):
        members = [r for r in rows[4 * b:4 * b + 4].tolist() if r >= 0]
        assert (e == -1) == (not members) and all(int(experts[r]) == e for r in members)
    assert block_expert.tolist() == [0, 1, 2, 2, -1, -1, -1]


def test_routed_experts_take_the_grouped_kernel_from_enough_pairs_on(monkeypatch):
    """The op's choice (`block_fp8_pairs`): per pair below GROUPED_MIN_PAIRS (decode steps), grouped from
    it on (prefill chunks, large batches); both give the reference's rows. Run here with the kernels in
    the interpreter, as a GPU with FP8 tensor cores would choose."""
    monkeypatch.setattr(bf, "fp8_gemm_supported", lambda device: True)
    monkeypatch.setattr(bf, "GROUPED_MIN_PAIRS", 40)
    called = []
    for name in ("block_fp8_pairs_triton", "block_fp8_grouped_triton"):
        real = getattr(bf, name)
        monkeypatch.setattr(bf, name, lambda *a, real=real, name=name: called.append(name) or real(*a))
    weight, scale = experts_stack(4, 64, 128, 64)
    for P in (39, 40):
        x, _, _ = layer(P, 64, 128, 64, seed=4)
        experts = torch.randint(0, 4, (P,), generator=torch.Generator().manual_seed(P))
        got = torch.ops.specgen.block_fp8_pairs(x, experts, weight, scale, 64)
        torch.testing.assert_close(got, bf.block_fp8_pairs_reference(x, experts, weight, scale, 64),
                                   rtol=1e-5, atol=1e-5)
    assert called == ["block_fp8_pairs_triton", "block_fp8_grouped_triton"]
