"""The Triton attention kernel (per-row lengths, GQA packed, split-K) equals the PyTorch reference.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py); on a machine
with CUDA every tensor is on the GPU, where the kernel compiles for real."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE

from specgen.kernels import attention as ak
from specgen.kernels import launch_configs
from specgen.models.attention import AttentionBatch, KVCache, attend


def case(B, T, Hq, Hkv, D, L=80, slots=None, seed=0, dtype=torch.float32, device=KERNEL_DEVICE):
    gen = torch.Generator().manual_seed(seed)
    S = slots or B + 2
    k_cache = torch.randn(S, Hkv, L, D, generator=gen).to(dtype)
    v_cache = torch.randn(S, Hkv, L, D, generator=gen).to(dtype)
    rows = torch.randperm(S, generator=gen)[:B]
    starts = torch.randint(0, L - T, (B,), generator=gen)
    positions = starts.unsqueeze(1) + torch.arange(T)
    # q as a strided view of a fused projection, the way the model makes it
    fused = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=gen).to(dtype)
    q = fused[..., : Hq * D].view(B, T, Hq, D)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, rows, positions))


@pytest.mark.parametrize("B,T,Hq,Hkv,D,splits", [
    (1, 1, 4, 4, 16, 1),     # one decode token, MHA
    (3, 4, 8, 2, 16, 1),     # verify block, GQA 4
    (2, 4, 8, 2, 16, 3),     # split-K: partial results merged by log-sum-exp
    (2, 9, 6, 3, 32, 2),     # tile rows (t, g) spanning several query tiles
    (1, 37, 4, 1, 24, 1),    # prefill-sized T, head_dim not a power of two, MQA
    (2, 5, 16, 4, 128, 2),   # Llama-3's head width, GQA 4
    (2, 3, 8, 1, 192, 2),    # DeepSeek-V3's q/k head width (192, padded to 256: the widest tiles)
])
def test_kernel_equals_reference(B, T, Hq, Hkv, D, splits):
    q, k_cache, v_cache, rows, positions = case(B, T, Hq, Hkv, D)
    L = k_cache.shape[2]
    mask = ak.causal_mask(positions, torch.arange(L, device=KERNEL_DEVICE))
    reference = ak.attention_reference(q, k_cache, v_cache, rows, mask, scale=D ** -0.5)
    out = ak.attention_triton(q, k_cache, v_cache, rows, positions.contiguous(), D ** -0.5, splits)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)


def test_a_head_wider_than_any_checked_configuration_is_refused():
    q, k_cache, v_cache, rows, positions = case(1, 1, 2, 1, 320, L=16)
    with pytest.raises(ValueError, match="head_dim 320"):
        ak.attention_triton(q, k_cache, v_cache, rows, positions, 0.1, 1)


def test_each_row_reads_only_its_own_length():
    """Keys past a row's position do not matter, whatever they hold (NaN included)."""
    q, k_cache, v_cache, rows, positions = case(2, 3, 4, 2, 16)
    out = ak.attention_triton(q, k_cache, v_cache, rows, positions, 0.25, 2)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    for b in range(2):
        poisoned_k[rows[b], :, positions[b, -1] + 1:] = float("nan")
        poisoned_v[rows[b], :, positions[b, -1] + 1:] = float("nan")
    again = ak.attention_triton(q, poisoned_k, poisoned_v, rows, positions, 0.25, 2)
    assert torch.equal(out, again)


def test_the_custom_op_and_attend_use_the_kernel():
    q, k_cache, v_cache, rows, positions = case(2, 4, 8, 2, 16)
    out = torch.ops.specgen.cached_attention(q, k_cache, v_cache, rows, positions, 0.25, 1)
    mask = ak.causal_mask(positions, torch.arange(k_cache.shape[2], device=KERNEL_DEVICE))
    torch.testing.assert_close(out, ak.attention_reference(q, k_cache, v_cache, rows, mask, 0.25),
                               atol=2e-5, rtol=2e-5)
    # attend() writes the new K/V first, then attends, on either path
    gen = torch.Generator().manual_seed(1)
    k_new, v_new = (torch.randn(2, 4, 2, 16, generator=gen).to(KERNEL_DEVICE) for _ in range(2))
    results = []
    for use_kernel in (False, True):
        cache = KVCache(1, k_cache.shape[0], 2, k_cache.shape[2], 16, torch.float32, KERNEL_DEVICE)
        cache.k[0].copy_(k_cache)
        cache.v[0].copy_(v_cache)
        batch = AttentionBatch.build(positions, rows, torch.arange(k_cache.shape[2], device=KERNEL_DEVICE),
                                     use_kernel)
        results.append(attend(q, k_new, v_new, cache, 0, batch))
    torch.testing.assert_close(results[1], results[0], atol=2e-5, rtol=2e-5)


def test_splits_follow_the_cache_alone_in_chunks_every_tile_divides():
    assert [ak.choose_splits(n) for n in (100, 256, 300, 2048, 4096, 32768)] == [1, 1, 2, 8, 16, 16]
    assert ak.split_chunk(2048, 8) == 256 and ak.split_chunk(32768, 16) == 2048
    assert ak.split_chunk(80, 3) == 64 and ak.split_chunk(80, 1) == 128
    for n in (80, 300, 2048, 5000):
        splits = ak.choose_splits(n)
        assert splits * ak.split_chunk(n, splits) >= n                      # every key in some split
    tiles = [launch.tiles for launch in (*launch_configs.ATTENTION.values(),
                                         *launch_configs.LATENT_ATTENTION.values())]
    assert all(ak.CHUNK_ALIGN % t["BLOCK_N"] == 0 for t in tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_query_gets_the_same_bits_alone_in_a_plain_step_and_inside_a_verify_block(dtype):
    """GPU_NOTES 2: the kernel's reduction order depends on the row's length alone. Queries at
    positions p .. p + 3 are attended as a K = 3 block beside two other rows, as the same block alone,
    and one at a time (plain steps), with the splits a decode step takes over a 600-position cache.
    On CPU the interpreter's float32 `tl.dot` is NumPy's matmul, which rounds a row by its place in
    the tile (t * GROUP + g), so there the plain step's t > 0 is compared in bf16 only; on a GPU every
    case is (tests/test_gpu.py runs this test on CUDA)."""
    q, k_cache, v_cache, rows, positions = case(3, 4, 8, 2, 64, L=600, dtype=dtype, seed=5)
    positions = torch.stack([torch.arange(4) + p for p in (431, 77, 290)]).to(KERNEL_DEVICE)
    splits = ak.choose_splits(600)
    assert splits == 3
    block = ak.attention_triton(q, k_cache, v_cache, rows, positions, 0.125, splits)
    own = ak.attention_triton(q[:1], k_cache, v_cache, rows[:1], positions[:1].contiguous(), 0.125, splits)
    assert torch.equal(own[0], block[0])
    numpy_dot = KERNEL_DEVICE.type == "cpu" and dtype == torch.float32
    for t in range(1 if numpy_dot else 4):
        alone = ak.attention_triton(q[:1, t:t + 1], k_cache, v_cache, rows[:1],
                                    positions[:1, t:t + 1].contiguous(), 0.125, splits)
        assert torch.equal(alone[0, 0], block[0, t])


@pytest.mark.parametrize("splits", [2, 5])
def test_the_merge_kernel_equals_the_merge_reference(splits):
    gen = torch.Generator().manual_seed(splits)
    part = torch.randn(2, 3, 4, splits, 40, generator=gen)
    lse = torch.randn(2, 3, 4, splits, generator=gen) * 3
    lse[0, 0, 0, 1:] = float("-inf")                 # a row whose later splits saw no key
    lse[1, 2, :, 0] = float("-inf")
    part[0, 0, 0, 1:] = 0.0
    part[1, 2, :, 0] = 0.0
    part, lse = part.to(KERNEL_DEVICE), lse.to(KERNEL_DEVICE)
    torch.testing.assert_close(ak.merge_splits_triton(part, lse, torch.float32),
                               ak.merge_splits(part, lse, torch.float32), atol=1e-5, rtol=1e-5)
    # bf16: the same float32 sums, rounded once (one bf16 step apart where they straddle a rounding)
    torch.testing.assert_close(ak.merge_splits_triton(part, lse, torch.bfloat16),
                               ak.merge_splits(part, lse, torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 1, 48)])
def test_row_invariant_reference_gives_a_query_the_same_bits_beside_drafts(dtype, Hq, Hkv, D):
    """The decode step's attention: a query's output does not depend on how many queries after it
    share the call (a token verified beside drafts == the same token decoded alone), and it is the
    same attention as SDPA's up to rounding."""
    # the CPU step's reference (no Triton): on the CPU on every machine
    q, k_cache, v_cache, rows, positions = case(2, 5, Hq, Hkv, D, L=300, dtype=dtype, device="cpu")
    key_index = torch.arange(290)

    def attention(t: int, invariant: bool = True) -> torch.Tensor:
        return ak.attention_reference(q[:, :t], k_cache, v_cache, rows, ak.causal_mask(positions[:, :t], key_index),
                                      row_invariant=invariant)

    alone = attention(1)
    for t in (2, 3, 5):
        beside = attention(t)
        assert torch.equal(beside[:, :1], alone), t
        assert beside.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(attention(5), attention(5, invariant=False), atol=tolerance, rtol=tolerance)
