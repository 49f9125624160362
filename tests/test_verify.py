"""verify() through the PyTorch reference: the acceptance rules, seeded equality with plain decoding, and
statistical losslessness of stochastic-draft rejection sampling (with negative controls)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specgen.kernels import keyed_noise as kn
from specgen.pipelines.verify import verify
from specgen.sampling import SamplingTensors, process_logits, sample_draft


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    return torch.tensor([kn.noise_key_for(seed, r) for r in range(n)], dtype=torch.int64)


def _positions(B: int, K: int, start: torch.Tensor | int = 0) -> torch.Tensor:
    return (torch.as_tensor(start).reshape(-1, 1) + torch.arange(K + 1)).expand(B, K + 1).contiguous()


def _plain(logprobs, greedy, key, positions):
    """Plain decoding of every row on its own (K = 0 through the same verify): [B, K+1]."""
    cols = []
    for i in range(logprobs.shape[1]):
        acc, em, _ = verify(logprobs[:, i : i + 1].contiguous(), positions[:, :0], None, greedy, key,
                            positions[:, i : i + 1].contiguous(), force_kernel=False)
        assert (acc == 0).all() and em.shape == (logprobs.shape[0], 1)
        cols.append(em[:, 0])
    return torch.stack(cols, dim=1)


def test_shapes_dtypes_and_padding():
    B, K, V = 4, 3, 11
    g = torch.Generator().manual_seed(0)
    logprobs = torch.randn(B, K + 1, V, generator=g).log_softmax(-1)
    drafts = torch.randint(0, V, (B, K), generator=g)
    greedy = torch.tensor([True, False, True, False])
    accepted, emitted, _ = verify(logprobs, drafts, None, greedy, _keys(B), _positions(B, K, 5))
    assert accepted.shape == (B,) and emitted.shape == (B, K + 1)
    assert accepted.dtype == emitted.dtype == torch.int64
    for b in range(B):
        n = int(accepted[b])
        assert 0 <= n <= K
        assert (emitted[b, : n + 1] >= 0).all() and (emitted[b, : n + 1] < V).all()
        assert (emitted[b, n + 1 :] == -1).all()
        assert torch.equal(emitted[b, :n], drafts[b, :n])


def test_greedy_accepts_exactly_the_argmax_prefix():
    B, K, V = 6, 4, 50
    logits = torch.randn(B, K + 1, V, generator=torch.Generator().manual_seed(1))
    argmax = logits.argmax(-1)
    drafts = argmax[:, :K].clone()
    for b, first_wrong in enumerate([0, 1, 2, 3, 4, 4]):  # 4 = all drafts right
        if first_wrong < K:
            drafts[b, first_wrong] = (drafts[b, first_wrong] + 1) % V
            drafts[b, first_wrong + 1 :] = (drafts[b, first_wrong + 1 :] + 7) % V
    greedy = torch.ones(B, dtype=torch.bool)
    draft_probs = torch.rand(B, K, V).softmax(-1)  # ignored for greedy rows
    for probs in (None, draft_probs):
        accepted, emitted, _ = verify(logits, drafts, probs, greedy, _keys(B), _positions(B, K), force_kernel=False)
        assert accepted.tolist() == [0, 1, 2, 3, 4, 4]
        for b in range(B):
            n = int(accepted[b])
            assert torch.equal(emitted[b, : n + 1], argmax[b, : n + 1])  # correction / bonus = argmax


def test_k0_is_plain_sampling():
    B, V = 8, 30
    logprobs = torch.randn(B, 1, V, generator=torch.Generator().manual_seed(2)).log_softmax(-1)
    greedy = torch.tensor([False] * 6 + [True] * 2)
    key, pos = _keys(B), torch.full((B, 1), 12)
    accepted, emitted, _ = verify(logprobs, torch.empty(B, 0, dtype=torch.int64), None, greedy, key, pos)
    assert accepted.tolist() == [0] * B
    g = kn.gumbel(key, pos, torch.arange(V), kn.TARGET)
    expect = torch.where(greedy[:, None, None], logprobs, logprobs + g).argmax(-1)
    assert torch.equal(emitted, expect)
    # the same sample whatever else is in the batch
    acc1, em1, _ = verify(logprobs[3:4], torch.empty(1, 0, dtype=torch.int64), None, greedy[3:4], key[3:4], pos[3:4])
    assert em1[0, 0] == emitted[3, 0]


@pytest.mark.parametrize("temperature", [0.7, 1.0, 0.0])
def test_one_hot_emits_exactly_the_plain_samples(temperature):
    # The seeded-equality property: every emitted token is the token plain decoding samples there.
    B, K, V = 400, 4, 12
    g = torch.Generator().manual_seed(3)
    params = SamplingTensors.build([temperature] * B, [0] * B, [1.0] * B, [0.0] * B)
    logprobs = process_logits(torch.randn(B, K + 1, V, generator=g) * 2, params)
    key = _keys(B, seed=int(temperature * 10))
    positions = _positions(B, K, torch.randint(0, 1000, (B,), generator=g))
    plain = _plain(logprobs, params.greedy, key, positions)
    # drafts: the plain samples, corrupted at random places so that acceptance lengths vary
    drafts = plain[:, :K].clone()
    corrupt = torch.rand(B, K, generator=g) < 0.25
    drafts = torch.where(corrupt, (drafts + 1 + torch.randint(0, V - 1, (B, K), generator=g)) % V, drafts)
    accepted, emitted, _ = verify(logprobs, drafts, None, params.greedy, key, positions)
    first_corrupt = torch.where(corrupt.any(1), corrupt.float().argmax(1), K)
    assert torch.equal(accepted, first_corrupt)
    assert len(set(accepted.tolist())) == K + 1  # every acceptance length occurs
    j = torch.arange(K + 1)
    assert torch.equal(emitted, torch.where(j <= accepted[:, None], plain, -1))


def test_stochastic_rules_edge_cases():
    B, K, V = 5, 3, 9
    g = torch.Generator().manual_seed(4)
    logprobs = torch.randn(B, K + 1, V, generator=g).log_softmax(-1)
    key, positions = _keys(B), _positions(B, K, 40)
    greedy = torch.zeros(B, dtype=torch.bool)
    drafts = torch.randint(0, V, (B, K), generator=g)
    # q == p: every draft is accepted (u < 1) and the bonus is the plain sample of row K
    accepted, emitted, _ = verify(logprobs, drafts, logprobs[:, :K].exp(), greedy, key, positions)
    assert accepted.tolist() == [K] * B
    assert torch.equal(emitted[:, :K], drafts)
    assert torch.equal(emitted[:, K], _plain(logprobs, greedy, key, positions)[:, K])
    # q puts mass where p has none: that draft is always rejected, and the residual p - q cannot
    # produce it
    masked = logprobs.clone()
    masked[:, :, 0] = float("-inf")
    q = torch.full((B, K, V), 1.0 / V)
    zero_drafts = torch.zeros(B, K, dtype=torch.int64)
    accepted, emitted, _ = verify(masked, zero_drafts, q, greedy, key, positions)
    assert accepted.tolist() == [0] * B and (emitted[:, 0] != 0).all() and (emitted[:, 1:] == -1).all()
    # residual all zero (q >= p everywhere, draft outside p's support): fall back to the plain sample
    big_q = masked[:, :K].exp() * 1.5
    accepted, emitted, _ = verify(masked, zero_drafts, big_q, greedy, key, positions)
    assert accepted.tolist() == [0] * B
    assert torch.equal(emitted[:, 0], _plain(masked, greedy, key, positions)[:, 0])


def test_verify_has_no_host_sync():
    B, K, V = 3, 2, 16
    g = torch.Generator().manual_seed(5)
    args = (
        torch.randn(B, K + 1, V, generator=g).log_softmax(-1),
        torch.randint(0, V, (B, K), generator=g),
        torch.rand(B, K, V, generator=g).softmax(-1),
        torch.tensor([False, True, False]),
        _keys(B),
        _positions(B, K, 3),
    )
    compiled = torch.compile(verify, backend="eager", fullgraph=True)
    for probs in (args[2], None):
        a = compiled(args[0], args[1], probs, *args[3:], force_kernel=False)
        b = verify(args[0], args[1], probs, *args[3:], force_kernel=False)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------------
# Statistical losslessness of rejection sampling with a poor stochastic draft
# ---------------------------------------------------------------------------------------------------

V, K, N = 8, 3, 20000


def _experiment(top_k: int, top_p: float):
    """Fixed per-row target p_0..p_K and draft q_0..q_{K-1}; N independent keys in one batch."""
    g = torch.Generator().manual_seed(11)
    params = SamplingTensors.build([1.0] * N, [top_k] * N, [top_p] * N, [0.0] * N)
    target_logits = (torch.randn(K + 1, V, generator=g) * 1.2).expand(N, K + 1, V).contiguous()
    draft_logits = (torch.randn(K, V, generator=g) * 1.5).expand(N, K, V).contiguous()  # unrelated: poor draft
    logprobs = process_logits(target_logits, params)
    draft_logprobs = process_logits(draft_logits, params)
    key = _keys(N, seed=77)
    positions = _positions(N, K, 100)
    drafts, draft_probs = [], []
    for i in range(K):
        tok, q = sample_draft(draft_logprobs[:, i], params.greedy, key, positions[:, i])
        drafts.append(tok)
        draft_probs.append(q)
    drafts = torch.stack(drafts, 1)
    draft_probs = torch.stack(draft_probs, 1).contiguous()
    p = logprobs[0].exp().double()  # [K+1, V]
    q = draft_probs[0].double()  # [K, V]
    return logprobs, drafts, draft_probs, params.greedy, key, positions, p, q


def _chisquare_p(tokens: torch.Tensor, p: torch.Tensor) -> float:
    support = p > 0
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[~support].sum() == 0, "emitted a token the target gives probability 0"
    expected = p[support] / p[support].sum() * tokens.numel()
    assert expected.min() >= 5, "too few samples for a chi-square test"
    return stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 0.9)])
def test_rejection_sampling_is_lossless(top_k, top_p):
    logprobs, drafts, draft_probs, greedy, key, positions, p, q = _experiment(top_k, top_p)
    if top_k:
        assert ((p > 0).sum(-1) < V).all()  # the filters really cut the support
    alpha = torch.minimum(p[:K], q).sum(-1)  # acceptance rate per row
    assert (alpha < 0.8).all(), "the draft should be poor"
    accepted, emitted, _ = verify(logprobs, drafts, draft_probs, greedy, key, positions)
    # row 0 always emits; row i emits iff the first i drafts were accepted, and since p_i and q_i do
    # not depend on earlier tokens, the emitted token given that event is distributed exactly p_i
    for i in range(K + 1):
        reached = accepted >= i
        assert reached.sum() > 500
        assert _chisquare_p(emitted[reached, i], p[i]) > 1e-3, f"row {i}"
    # the first accept rate is min(p, q) summed (within 5 standard errors)
    rate = (accepted >= 1).double().mean()
    assert abs(rate - alpha[0]) < 5 * (alpha[0] * (1 - alpha[0]) / N).sqrt()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 0.9)])
def test_rejection_sampling_negative_controls(top_k, top_p):
    # the chi-square test above must be able to fail: two wrong verifiers are rejected decisively
    logprobs, drafts, draft_probs, greedy, key, positions, p, q = _experiment(top_k, top_p)
    x0 = drafts[:, 0]
    # (1) accept every draft: the first token follows q_0
    assert _chisquare_p_lenient(x0, p[0]) < 1e-6
    # (2) right accept test, but resample from p instead of the residual after a rejection
    u = kn.uniform(key, positions[:, :1], torch.zeros(1, dtype=torch.long), kn.ACCEPT)[:, 0, 0]
    p_x = logprobs[:, 0].gather(1, x0[:, None]).squeeze(1).exp()
    q_x = draft_probs[:, 0].gather(1, x0[:, None]).squeeze(1)
    y0 = logprobs[:, 0] + kn.gumbel(key, positions[:, :1], torch.arange(V), kn.TARGET)[:, 0]
    wrong = torch.where(u * q_x < p_x, x0, y0.argmax(-1))
    assert _chisquare_p(wrong, p[0]) < 1e-6


def _chisquare_p_lenient(tokens: torch.Tensor, p: torch.Tensor) -> float:
    # tokens outside p's support already disprove losslessness
    if (torch.bincount(tokens, minlength=V)[p == 0] > 0).any():
        return 0.0
    return _chisquare_p(tokens, p)


def test_one_hot_with_sampled_drafts_is_lossless_too():
    # draft_probs=None with stochastic drafts: sample-and-match, output exactly p (ALGORITHMS 4.4)
    logprobs, drafts, _, greedy, key, positions, p, q = _experiment(0, 1.0)
    accepted, emitted, _ = verify(logprobs, drafts, None, greedy, key, positions)
    for i in range(2):  # deeper rows are reached too rarely at this acceptance rate for a chi-square
        reached = accepted >= i
        assert _chisquare_p(emitted[reached, i], p[i]) > 1e-3
    # acceptance rate of sample-and-match is sum p * q, below the rejection rule's sum min(p, q)
    expect = (p[0] * q[0]).sum()
    assert abs((accepted >= 1).double().mean() - expect) < 5 * np.sqrt(float(expect * (1 - expect)) / N)


def test_all_greedy_fast_path_equals_the_reference():
    """verify(..., all_greedy=True) skips the noise; it must agree with the general path."""
    gen = torch.Generator().manual_seed(11)
    B, K, V = 6, 4, 50
    logprobs = torch.randn(B, K + 1, V, generator=gen)
    y = logprobs.argmax(-1)
    drafts = y[:, :K].clone()
    drafts[1, 0] = (drafts[1, 0] + 1) % V
    drafts[3, 2] = (drafts[3, 2] + 1) % V
    greedy = torch.ones(B, dtype=torch.bool)
    key = torch.arange(B, dtype=torch.long)
    positions = torch.arange(K + 1).expand(B, K + 1) + 10
    fast = verify(logprobs, drafts, None, greedy, key, positions, all_greedy=True)
    general = verify(logprobs, drafts, None, greedy, key, positions, force_kernel=False)
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
    assert fast[0].tolist() == [K, 0, K, 2, K, K]
