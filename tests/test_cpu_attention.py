"""The C++ decode attention of compiled CPU steps (kernels/cpu_attention.py): the reference's contract,
row invariance to the bit, and the compiled step really calling it."""

from __future__ import annotations

import pytest
import torch

from specgen.kernels import attention as ak
from specgen.kernels import cpu_attention as ca


def case(B, T, Hq, Hkv, D, L, kv_len, dtype, seed=0):
    # caches of exactly B slots (the step's: row b reads slot b); positions end anywhere before kv_len
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
    v_cache = torch.randn(B, Hkv, L, D, generator=gen).to(dtype)
    ends = torch.randint(T - 1, kv_len, (B,), generator=gen)
    positions = ends.unsqueeze(1) - (T - 1) + torch.arange(T)
    # q as a strided view of a fused projection, the way the model makes it
    fused = torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=gen).to(dtype)
    return fused[..., : Hq * D].view(B, T, Hq, D), k_cache, v_cache, positions


@pytest.mark.parametrize("B,T,Hq,Hkv,D,L,kv_len,dtype", [
    (1, 1, 9, 3, 64, 96, 40, torch.bfloat16),     # SmolLM2's heads, a plain decode step, one chunk
    (1, 3, 9, 3, 64, 400, 300, torch.bfloat16),   # a verify of 2 drafts over three chunks
    (3, 4, 8, 2, 64, 300, 300, torch.float32),    # several slots, each its own lengths
    (2, 2, 12, 2, 24, 200, 150, torch.float32),   # group of 6 (a full and a partial row tile); D not a vector multiple
    (2, 3, 4, 1, 40, 160, 130, torch.float16),    # MQA, MLA-like (one latent head), float16
    (1, 5, 4, 4, 16, 64, 64, torch.float32),      # MHA, rows up to the last key
])
def test_the_cpu_kernel_computes_the_reference(B, T, Hq, Hkv, D, L, kv_len, dtype):
    q, k_cache, v_cache, positions = case(B, T, Hq, Hkv, D, L, kv_len, dtype)
    key_index = torch.arange(kv_len)
    mask = ak.causal_mask(positions, key_index)
    reference = ak.attention_reference(q, k_cache, v_cache, None, mask, D ** -0.5, row_invariant=True)
    out = ca.decode_attention(q, k_cache, v_cache, positions, key_index, D ** -0.5)
    assert out.dtype == q.dtype and out.shape == q.shape
    # both sum in float32 (in other orders); bf16/fp16 outputs may then round one step apart
    tolerance = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float(), reference.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_query_gets_the_same_bits_whatever_rows_and_cached_length_share_its_call(dtype):
    """Row invariance: the last query of a 4-row verify == that query alone (a plain step), at a kv
    bound just past it and at a longer one (another cache bucket), across several key chunks."""
    B, T, Hq, Hkv, D, L = 2, 4, 9, 3, 64, 700
    q, k_cache, v_cache, _ = case(B, T, Hq, Hkv, D, L, L, dtype, seed=1)
    positions = torch.tensor([[397, 398, 399, 400], [9, 10, 11, 12]])
    verify = ca.decode_attention(q, k_cache, v_cache, positions, torch.arange(448), D ** -0.5)
    for t in range(T):
        for kv_len in (int(positions[:, t].max()) + 1, L):
            alone = ca.decode_attention(q[:, t:t + 1].contiguous(), k_cache, v_cache, positions[:, t:t + 1],
                                        torch.arange(kv_len), D ** -0.5)
            assert torch.equal(alone, verify[:, t:t + 1]), (t, kv_len)
    # and a slot's rows never depend on the other slots
    first = ca.decode_attention(q[:1].contiguous(), k_cache[:1], v_cache[:1], positions[:1], torch.arange(448),
                                D ** -0.5)
    assert torch.equal(first, verify[:1])


def test_a_cpu_step_attends_through_the_kernel_compiled_and_eager(monkeypatch):
    """A row-invariant CPU attention is one call of the op, compiled (no Inductor-generated softmax)
    and eager (an eager step's rows must not depend on its key bound either), and gives the
    reference's numbers."""
    from specgen.models.attention import AttentionBatch, KVCache, attend

    B, T, Hq, Hkv, D, L = 1, 3, 6, 2, 32, 64
    cache = KVCache(1, B, Hkv, L, D, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, T, h, D, generator=gen) for h in (Hq, Hkv, Hkv))
    positions = torch.tensor([[20, 21, 22]])

    def step(q, k, v, positions, key_index):
        batch = AttentionBatch.build(positions, None, key_index, use_kernel=False, row_invariant=True)
        return attend(q, k, v, cache, 0, batch)

    calls = []
    real = ca.decode_attention

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(ca, "decode_attention", counted)
    eager = step(q, k, v, positions, torch.arange(32))
    assert calls == [q.shape]
    compiled = torch.compile(step, fullgraph=True)(q, k, v, positions, torch.arange(32))
    assert calls == [q.shape, q.shape]
    assert torch.equal(compiled, eager)
    mask = AttentionBatch.build(positions, None, torch.arange(32), use_kernel=False).mask
    reference = ak.attention_reference(q, cache.k[0], cache.v[0], None, mask, row_invariant=True)
    torch.testing.assert_close(eager, reference, rtol=2e-6, atol=2e-6)
