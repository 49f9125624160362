"""MLA's latent attention kernel equals its PyTorch reference, at small widths and at DeepSeek-V3's.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py); on a machine
with CUDA every tensor is on the GPU, where the kernel compiles for real (GPU_NOTES 1: the widths that
matter are 512 latent + 64 rope values, 128 heads for DeepSeek-V3 and 64 for Kimi K2.5)."""

from __future__ import annotations

import pytest
import torch
from kernel_device import KERNEL_DEVICE

from specgen.kernels import attention as generic
from specgen.kernels import latent_attention as lk
from specgen.models.attention import AttentionBatch, attend_latent
from specgen.models.mla import LatentCache


def case(B, T, H, R, P, L=48, seed=0, dtype=torch.float32):
    # -> q [B, T, H, R + P] (a strided view, as the model's cat makes a fresh one), cache [S, 1, L, R + P]
    gen = torch.Generator().manual_seed(seed)
    S = B + 2
    cache = torch.randn(S, 1, L, R + P, generator=gen).to(dtype)
    rows = torch.randperm(S, generator=gen)[:B]
    starts = torch.randint(0, L - T, (B,), generator=gen)
    positions = starts.unsqueeze(1) + torch.arange(T)
    wide = torch.randn(B, T, H, R + P + 8, generator=gen).to(dtype) * 0.2
    q = wide[..., : R + P]
    return tuple(t.to(KERNEL_DEVICE) for t in (q, cache, rows, positions))


@pytest.mark.parametrize("B,T,H,R,P,splits", [
    (1, 1, 4, 32, 16, 1),      # one decode token
    (3, 4, 8, 32, 16, 1),      # verify block: (t, head) rows across tiles
    (2, 4, 8, 32, 16, 3),      # split-K: partial results merged by log-sum-exp
    (2, 3, 6, 40, 8, 2),       # widths not powers of two (masked lanes)
    (1, 2, 128, 512, 64, 2),   # DeepSeek-V3: 128 heads, 512 latent + 64 rope
    (2, 2, 64, 512, 64, 1),    # Kimi K2.5: 64 heads
])
def test_kernel_equals_reference(B, T, H, R, P, splits):
    q, cache, rows, positions = case(B, T, H, R, P)
    scale = 192 ** -0.5
    reference = lk.latent_attention_reference(q, cache, rows, positions, scale, R)
    out = lk.latent_attention_triton(q, cache, rows, positions.contiguous(), scale, R, splits)
    assert out.shape == (B, T, H, R)
    torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)


def test_the_reference_is_generic_attention_with_keys_and_values_the_entries():
    """Spelled out from raw tensors: scores over the whole entry, values its latent part."""
    q, cache, rows, positions = case(2, 3, 4, 32, 16)
    out = lk.latent_attention_reference(q, cache, rows, positions, 0.3, 32)
    for b in range(2):
        for t in range(3):
            entries = cache[rows[b], 0, : positions[b, t] + 1]                     # [n, R + P]
            probs = torch.softmax(q[b, t] @ entries.T * 0.3, dim=-1)              # [H, n]
            torch.testing.assert_close(out[b, t], probs @ entries[:, :32], atol=1e-5, rtol=1e-5)


def test_each_row_reads_only_its_own_length():
    """Entries past a row's position do not matter, whatever they hold (NaN included)."""
    q, cache, rows, positions = case(2, 3, 8, 32, 16)
    out = lk.latent_attention_triton(q, cache, rows, positions, 0.25, 32, 2)
    poisoned = cache.clone()
    for b in range(2):
        poisoned[rows[b], :, positions[b, -1] + 1:] = float("nan")
    assert torch.equal(out, lk.latent_attention_triton(q, poisoned, rows, positions, 0.25, 32, 2))


def test_entries_wider_than_any_checked_configuration_are_refused():
    q, cache, rows, positions = case(1, 1, 2, 1024, 64, L=8)
    with pytest.raises(ValueError, match="1024 \\+ 64"):
        lk.latent_attention_triton(q, cache, rows, positions, 0.1, 1024)


def test_attend_latent_takes_the_kernel_on_the_kernel_path(monkeypatch):
    """`attend_latent` writes the entries, then the kernel path == the reference path, and the kernel
    path calls the latent op (not the generic one)."""
    B, T, H, R, P, L = 2, 3, 8, 32, 16, 24
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, H, R + P, generator=gen).to(KERNEL_DEVICE)
    entry = torch.randn(B, T, 1, R + P, generator=gen).to(KERNEL_DEVICE)
    positions = (torch.tensor([[5], [9]]) + torch.arange(T)).to(KERNEL_DEVICE)
    outs = {}
    for use_kernel in (False, True):
        cache = LatentCache(1, B, L, R + P, torch.float32, KERNEL_DEVICE)
        cache.k[0].copy_(torch.randn(B, 1, L, R + P, generator=torch.Generator().manual_seed(4)))
        batch = AttentionBatch.build(positions, None, torch.arange(12, device=KERNEL_DEVICE), use_kernel)
        outs[use_kernel] = attend_latent(q, entry, cache, 0, batch, 0.2, R)
    torch.testing.assert_close(outs[True], outs[False], atol=2e-5, rtol=2e-5)

    called = []
    monkeypatch.setattr(generic, "cached_attention", lambda *a: called.append("generic"))
    real = lk.latent_attention
    monkeypatch.setattr(lk, "latent_attention", lambda *a: called.append("latent") or real(*a))
    cache = LatentCache(1, B, L, R + P, torch.float32, KERNEL_DEVICE)
    attend_latent(q, entry, cache, 0, AttentionBatch.build(positions, None, positions[:, :1], True), 0.2, R)
    assert called == ["latent"]
