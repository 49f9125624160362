"""Keyed noise (PyTorch side), SamplingTensors, process_logits and sample_draft."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from specgen.kernels import keyed_noise as kn
from specgen.sampling import SamplingTensors, process_logits, sample_draft

# ---------------------------------------------------------------------------------------------------
# keyed noise
# ---------------------------------------------------------------------------------------------------


def test_mix32_tensor_matches_python_ints():
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF, 123456789, 0xDEADBEEF]
    values += torch.randint(0, 2**32, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    out = kn.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert out == [kn.mix32_int(v) for v in values]
    assert all(0 <= o < 2**32 for o in out)


def test_noise_definition_golden_values():
    # Pinned: changing the definition changes every seeded output, so it must be a deliberate act.
    assert kn.noise_key_for(0, 0) == 3760792759
    assert kn.noise_key_for(1234, 5) == 2267482772
    key = torch.tensor([kn.noise_key_for(1234, 5)])
    bits = kn.noise_bits(key, torch.tensor([[17]]), torch.tensor([0, 1, 150000]), kn.TARGET)
    assert bits[0, 0].tolist() == [3076832284, 1508067957, 3975809922]

    def by_hand(k: int, t: int, v: int, s: int) -> int:
        row = kn.mix32_int(kn.mix32_int(k ^ kn.STREAM_SALT[s]) + t)
        return kn.mix32_int(kn.mix32_int(row ^ v) + kn.GOLDEN)

    assert bits[0, 0].tolist() == [by_hand(int(key), 17, v, kn.TARGET) for v in (0, 1, 150000)]


def test_noise_key_for_range_and_spread():
    keys = {kn.noise_key_for(seed, r) for seed in range(4) for r in range(500)}
    assert len(keys) == 2000
    assert all(0 <= k < 2**32 for k in keys)
    assert kn.noise_key_for(3, 9) == kn.noise_key_for(3, 9)
    assert kn.noise_key_for(-1, 2**70 + 5) == kn.noise_key_for(2**64 - 1, 5)  # both taken mod 2**64


def test_uniform_is_open_exact_and_position_keyed():
    key = torch.tensor([5, 2**32 - 1, 0])
    pos = torch.tensor([[0, 1, 2**31], [7, 8, 9], [2**32 + 3, 4, 5]])
    vocab = torch.arange(1000)
    u = kn.uniform(key, pos, vocab, kn.ACCEPT)
    assert u.shape == (3, 3, 1000) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    scaled = u.double() * 2**24  # cell centres: odd multiples of 2**-24
    assert torch.equal(scaled, scaled.round()) and (scaled.long() % 2 == 1).all()
    # keyed by position, not by call: any sub-batch reproduces the same numbers
    sub = kn.uniform(key[1:2], pos[1:2, 1:], vocab[100:200], kn.ACCEPT)
    assert torch.equal(sub, u[1:2, 1:, 100:200])
    # positions are taken mod 2**32
    assert torch.equal(kn.uniform(key[2:], torch.tensor([[3]]), vocab, kn.ACCEPT), u[2:, :1])


def test_noise_differs_across_coordinates():
    key = torch.tensor([11, 12])
    pos = torch.tensor([[40, 41], [40, 41]])
    vocab = torch.arange(64)
    base = kn.noise_bits(key, pos, vocab, kn.TARGET)
    assert (base[0] != base[1]).all()  # keys
    assert (base[:, 0] != base[:, 1]).all()  # positions
    assert base[0, 0].unique().numel() == 64  # token ids
    for s in (kn.DRAFT, kn.ACCEPT, kn.RESIDUAL):  # streams
        assert (kn.noise_bits(key, pos, vocab, s) != base).all()


def test_noise_uniformity_and_gumbel_moments():
    key = torch.tensor([kn.noise_key_for(0, r) for r in range(10)])
    pos = torch.arange(10)[None].repeat(10, 1) * 3 + 1
    vocab = torch.arange(1000)
    u = kn.uniform(key, pos, vocab, kn.TARGET).flatten().double().numpy()  # 100k values
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    # neighbouring token ids and the same coordinates in another stream are uncorrelated
    grid = u.reshape(100, 1000)
    assert abs(np.corrcoef(grid[:, :-1].ravel(), grid[:, 1:].ravel())[0, 1]) < 0.02
    other = kn.uniform(key, pos, vocab, kn.DRAFT).flatten().double().numpy()
    assert abs(np.corrcoef(u, other)[0, 1]) < 0.02
    g = kn.gumbel(key, pos, vocab, kn.TARGET).double()
    assert torch.isfinite(g).all()
    assert abs(g.mean().item() - 0.5772156649) < 0.02  # Euler-Mascheroni
    assert abs(g.var().item() - math.pi**2 / 6) < 0.05


# ---------------------------------------------------------------------------------------------------
# SamplingTensors
# ---------------------------------------------------------------------------------------------------


def test_build_flags_and_validation():
    st = SamplingTensors.build([0.0, 0.7], [50, 0], [1.0, 1.0], [0.0, 0.0])
    assert st.greedy.tolist() == [True, False]
    assert (st.all_greedy, st.use_top_k, st.use_top_p, st.use_min_p) == (False, False, False, False)
    assert st.temperature.dtype == torch.float32 and st.top_k.dtype == torch.int64
    st = SamplingTensors.build([0.0, 0.0], [0, 0], [0.5, 1.0], [0.1, 0.0])
    assert st.all_greedy and not st.use_top_p and not st.use_min_p  # filters on greedy rows: no-ops
    for bad in (
        ([-1.0], [0], [1.0], [0.0]),
        ([1.0], [-2], [1.0], [0.0]),
        ([1.0], [0], [0.0], [0.0]),
        ([1.0], [0], [1.0], [1.5]),
        ([1.0, 1.0], [0], [1.0], [0.0]),
    ):
        with pytest.raises(ValueError):
            SamplingTensors.build(*bad)


def test_update_row_writes_in_place_and_only_widens():
    st = SamplingTensors.build([0.0, 0.0], [0, 0], [1.0, 1.0], [0.0, 0.0])
    temperature = st.temperature
    assert st.all_greedy
    st.update_row(1, 0.8, 20, 0.9, 0.05)
    assert st.temperature is temperature  # same storage: a captured graph sees the new values
    assert st.temperature.tolist() == pytest.approx([0.0, 0.8])
    assert st.top_k.tolist() == [0, 20] and st.greedy.tolist() == [True, False]
    assert (st.all_greedy, st.use_top_k, st.use_top_p, st.use_min_p) == (False, True, True, True)
    st.update_row(1, 0.0, 0, 1.0, 0.0)  # back to greedy: flags stay wide
    assert st.greedy.tolist() == [True, True]
    assert (st.all_greedy, st.use_top_k, st.use_top_p, st.use_min_p) == (False, True, True, True)


# ---------------------------------------------------------------------------------------------------
# process_logits
# ---------------------------------------------------------------------------------------------------


def _reference_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Straightforward float64 version of one row: [V] -> [V] log-probabilities."""
    if temperature == 0:
        return logits.astype(np.float32).astype(np.float64)
    x = logits.astype(np.float64) / temperature
    V = x.size
    if 0 < top_k < V:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x < kth, -np.inf, x)
    if top_p < 1:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        keep = np.zeros(V, bool)
        mass = 0.0
        for rank, v in enumerate(np.argsort(-x, kind="stable")):
            if rank == 0 or mass < top_p:
                keep[v] = True
            mass += probs[v]
        x = np.where(keep, x, -np.inf)
    if min_p > 0:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        x = np.where(probs < min_p * probs.max(), -np.inf, x)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


ROWS = [  # temperature, top_k, top_p, min_p
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.6, 0, 1.0, 0.0),
    (1.3, 5, 1.0, 0.0),
    (1.0, 0, 0.7, 0.0),
    (0.8, 0, 1.0, 0.08),
    (0.9, 12, 0.85, 0.0),
    (1.2, 20, 0.9, 0.02),
    (0.0, 3, 0.5, 0.1),
    (1.0, 1, 1.0, 0.0),
    (1.0, 0, 1e-6, 0.0),
    (1.0, 0, 1.0, 1.0),
    (0.7, 500, 1.0, 0.0),
]


@pytest.mark.parametrize("subset", ["all", "temperature_only", "top_k_only", "top_p_only", "min_p_only",
                                    "every_sampled_row_has_top_k"])
def test_process_logits_matches_reference(subset):
    rows = {
        "all": ROWS,   # some sampled rows without top-k: top-p by radix select
        "every_sampled_row_has_top_k": [r for r in ROWS if r[0] == 0 or r[1] > 0],   # top-k window
        "temperature_only": [r for r in ROWS if r[1:] == (0, 1.0, 0.0)],
        "top_k_only": [r for r in ROWS if r[2:] == (1.0, 0.0)],
        "top_p_only": [r for r in ROWS if r[1] == 0 and r[3] == 0.0],
        "min_p_only": [r for r in ROWS if r[1:3] == (0, 1.0)],
    }[subset]
    B, T, V = len(rows), 3, 64
    logits = torch.randn(B, T, V, generator=torch.Generator().manual_seed(3)) * 3
    params = SamplingTensors.build(*map(list, zip(*rows)))
    out = process_logits(logits, params)
    assert out.shape == (B, T, V) and out.dtype == torch.float32
    for b, row in enumerate(rows):
        for t in range(T):
            expect = _reference_row(logits[b, t].numpy(), *row)
            got = out[b, t].double().numpy()
            assert np.array_equal(np.isneginf(got), np.isneginf(expect)), (row, t)
            finite = np.isfinite(expect)
            np.testing.assert_allclose(got[finite], expect[finite], rtol=0, atol=2e-5)
            top = int(logits[b, t].argmax())
            assert np.isfinite(got[top])  # the top token always survives


@pytest.mark.parametrize("top_k", [0, 30], ids=["radix-select", "top-k-window"])
def test_top_p_cuts_through_ties_as_a_stable_sort_does(top_k):
    """Integer logits: many exact ties, also at the top-p and top-k cut-offs. Survivors among tied
    tokens are the lowest ids, and as many as the rank-order definition allows."""
    rows = [(1.0, top_k, p, 0.0) for p in (0.05, 0.3, 0.5, 0.77, 0.9, 0.999)]
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(-2, 3, (len(rows), 4, 40), generator=gen).float()
    params = SamplingTensors.build(*map(list, zip(*rows)))
    assert params.top_k_window == top_k
    out = process_logits(logits, params)
    for b, row in enumerate(rows):
        for t in range(4):
            expect = _reference_row(logits[b, t].numpy(), *row)
            got = out[b, t].double().numpy()
            assert np.array_equal(np.isneginf(got), np.isneginf(expect)), (row, t)


def test_top_p_radix_select_matches_the_sort_on_a_real_vocabulary_size():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 2, 49152, generator=gen) * 4
    rows = [(0.7, 0, p, 0.0) for p in (0.1, 0.5, 0.8, 0.9, 0.95, 0.99)]
    out = process_logits(logits, SamplingTensors.build(*map(list, zip(*rows))))
    for b, row in enumerate(rows):
        for t in range(2):
            expect = _reference_row(logits[b, t].numpy(), *row)
            kept, expected = np.isfinite(out[b, t].numpy()), np.isfinite(expect)
            # float32 masses against float64 ones: at most a token at the boundary may differ
            assert abs(int(kept.sum()) - int(expected.sum())) <= 1 and (kept & expected).sum() >= expected.sum() - 1


def test_top_p_just_below_one_keeps_a_whole_row():
    """float32 masses may sum to less than a top_p of 1 - 1e-7: the row must keep its tokens (the
    cut-off falls to the lowest bucket), never lose them all to a NaN cut-off."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 1, 49152, generator=gen) * 0.5    # flat: every token holds ~2e-5 > 1e-7
    params = SamplingTensors.build([1.0] * 4, [0] * 4, [1 - 1e-7] * 4, [0.0] * 4)
    out = process_logits(logits, params)
    assert not torch.isnan(out).any()
    for b in range(4):    # in float64 no token's tail is below 1e-7: the reference keeps every one
        assert np.isfinite(_reference_row(logits[b, 0].numpy(), 1.0, 0, 1 - 1e-7, 0.0)).all()
    assert torch.isfinite(out).all()


def test_process_logits_greedy_rows_and_dtypes():
    logits = torch.randn(2, 2, 10, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    params = SamplingTensors.build([0.0, 0.0], [2, 0], [0.3, 1.0], [0.0, 0.0])
    out = process_logits(logits, params)
    assert out.dtype == torch.float32 and torch.equal(out, logits.float())
    params = SamplingTensors.build([0.0, 1.0], [2, 2], [1.0, 1.0], [0.0, 0.0])
    out = process_logits(logits, params)
    assert torch.equal(out[0], logits[0].float())
    assert (torch.isfinite(out[1]).sum(-1) == 2).all()


def test_process_logits_has_no_host_sync():
    # fullgraph tracing fails on .item(), .tolist() or branching on tensor values
    params = SamplingTensors.build([0.0, 0.9, 1.1], [0, 4, 0], [1.0, 0.8, 1.0], [0.0, 0.0, 0.1])
    logits = torch.randn(3, 2, 32, generator=torch.Generator().manual_seed(4))

    def step(logits, temperature, top_k, top_p, min_p, greedy, window):
        p = SamplingTensors(temperature, top_k, top_p, min_p, greedy, False, True, True, True, 4, window)
        return process_logits(logits, p)

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    args = (params.temperature, params.top_k, params.top_p, params.min_p, params.greedy)
    assert params.top_k_window == 0 and params.max_top_k == 4
    assert torch.equal(compiled(logits, *args, 0), process_logits(logits, params))   # radix select
    windowed = SamplingTensors.build([0.0, 0.9, 1.1], [0, 4, 3], [1.0, 0.8, 0.9], [0.0, 0.0, 0.1])
    assert windowed.top_k_window == 4
    args = (windowed.temperature, windowed.top_k, windowed.top_p, windowed.min_p, windowed.greedy)
    assert torch.equal(compiled(logits, *args, 4), process_logits(logits, windowed))   # top-k window


# ---------------------------------------------------------------------------------------------------
# sample_draft
# ---------------------------------------------------------------------------------------------------


def test_sample_draft_greedy_and_probs():
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))
    params = SamplingTensors.build([0.0, 1.0, 0.0, 0.7], [0] * 4, [1.0] * 4, [0.0] * 4)
    logprobs = process_logits(logits[:, None], params)[:, 0]
    key = torch.tensor([1, 2, 3, 4])
    pos = torch.tensor([10, 10, 11, 12])
    token, probs = sample_draft(logprobs, params.greedy, key, pos)
    assert token.dtype == torch.int64 and probs.dtype == torch.float32 and probs.shape == (4, 16)
    for b in (0, 2):
        assert token[b] == logits[b].argmax()
        assert torch.equal(probs[b], torch.nn.functional.one_hot(token[b], 16).float())
    g = kn.gumbel(key, pos[:, None], torch.arange(16), kn.DRAFT)[:, 0]  # [B, V]
    for b in (1, 3):
        torch.testing.assert_close(probs[b], logprobs[b].softmax(-1))
        assert token[b] == (logprobs[b] + g[b]).argmax()
    # deterministic, and keyed by (key, position): the same row in another batch gives the same token
    again, _ = sample_draft(logprobs[1:2], params.greedy[1:2], key[1:2], pos[1:2])
    assert again[0] == token[1]


def test_sample_draft_distribution():
    N, V = 20000, 6
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    logprobs = p.log()[None].expand(N, V).contiguous()
    key = torch.tensor([kn.noise_key_for(9, r) for r in range(N)])
    token, _ = sample_draft(logprobs, torch.zeros(N, dtype=torch.bool), key, torch.full((N,), 3))
    counts = torch.bincount(token, minlength=V).numpy()
    assert stats.chisquare(counts, p.double().numpy() * N).pvalue > 1e-3


def test_sample_draft_has_no_host_sync():
    logprobs = torch.randn(3, 20, generator=torch.Generator().manual_seed(6)).log_softmax(-1)
    args = (logprobs, torch.tensor([True, False, False]), torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3]))
    compiled = torch.compile(sample_draft, backend="eager", fullgraph=True)
    for a, b in zip(compiled(*args), sample_draft(*args)):
        assert torch.equal(a, b)


def test_top_p_keeps_the_same_tokens_whatever_order_its_masses_are_added_in(monkeypatch):
    """GPU_NOTES 2: radix select sums each bucket's probability mass with `scatter_add_`, which on
    CUDA adds with atomics, in a new order each run. Summed in floats, the order moved the mass's last
    bits, and with them how many tokens tied at the cut-off survive; summed in fixed point it cannot.
    Here `scatter_add_` adds its elements in shuffled orders (what atomics do), on rows of varied tokens
    above a block of tied ones, top_p placed so that the tied tokens' allowance lands near a whole
    number: every order keeps the same tokens."""
    gen = torch.Generator().manual_seed(11)
    V, rows = 4096, 24
    logits = torch.full((rows, 1, V), -30.0)
    logits[:, 0, :300] = torch.randn(rows, 300, generator=gen) * 0.3 + 2.0        # above the cut-off
    logits[:, 0, 300:700] = 1.0                                                    # tied at the cut-off
    probs = torch.softmax(logits[:, 0].double(), dim=-1)
    above, tie = probs[:, :300].sum(-1), probs[:, 300]
    top_p = (above + 137.0 * tie).float().tolist()          # the allowance: 137 tied tokens, to rounding
    params = SamplingTensors.build([1.0] * rows, [0] * rows, top_p, [0.0] * rows)
    base = process_logits(logits, params)
    in_order = torch.Tensor.scatter_add_
    for seed in range(6):
        order = torch.randperm(V, generator=torch.Generator().manual_seed(seed))

        def shuffled(self, dim, index, src, order=order):
            return in_order(self, dim, index[..., order], src[..., order])

        monkeypatch.setattr(torch.Tensor, "scatter_add_", shuffled)
        moved = process_logits(logits, params)
        monkeypatch.undo()
        assert torch.equal(torch.isfinite(moved), torch.isfinite(base))
