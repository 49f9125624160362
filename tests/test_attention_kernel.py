"""The Triton attention kernel (per-row lengths, GQA packed, split-K) equals the PyTorch reference.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py); on a machine
with CUDA every tensor is on the GPU, where the kernel compiles for real."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE

from specgen.kernels import attention as ak
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
    (2, 3, 8, 1, 320, 2),    # MLA-like: one latent head wider than 256 (the wide-head tile sizes)
])
def test_kernel_equals_reference(B, T, Hq, Hkv, D, splits):
    q, k_cache, v_cache, rows, positions = case(B, T, Hq, Hkv, D)
    L = k_cache.shape[2]
    mask = ak.causal_mask(positions, torch.arange(L, device=KERNEL_DEVICE))
    reference = ak.attention_reference(q, k_cache, v_cache, rows, mask, scale=D ** -0.5)
    blocks = {} if D > ak.WIDE_HEAD_DIM else {"block_m": 16, "block_n": 16}
    out = ak.attention_triton(q, k_cache, v_cache, rows, positions.contiguous(), D ** -0.5, splits, **blocks)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)


def test_each_row_reads_only_its_own_length():
    """Keys past a row's position do not matter, whatever they hold (NaN included)."""
    q, k_cache, v_cache, rows, positions = case(2, 3, 4, 2, 16)
    out = ak.attention_triton(q, k_cache, v_cache, rows, positions, 0.25, 2, block_m=16, block_n=16)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    for b in range(2):
        poisoned_k[rows[b], :, positions[b, -1] + 1:] = float("nan")
        poisoned_v[rows[b], :, positions[b, -1] + 1:] = float("nan")
    again = ak.attention_triton(q, poisoned_k, poisoned_v, rows, positions, 0.25, 2, block_m=16, block_n=16)
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


def test_choose_splits_fills_the_device_but_keeps_splits_long():
    assert ak.choose_splits(batch=1, kv_heads=8, tiles=1, max_len=4096, num_sms=132) == 16
    assert ak.choose_splits(batch=64, kv_heads=8, tiles=1, max_len=4096, num_sms=132) == 1
    assert ak.choose_splits(batch=1, kv_heads=8, tiles=1, max_len=300, num_sms=132) == 1


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
