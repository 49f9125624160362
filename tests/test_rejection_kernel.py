"""The Triton verify kernel and keyed-noise device functions against their PyTorch references.

On CPU the kernels run in Triton's interpreter. `triton.jit` picks interpreter or compiler when it
decorates, and specgen decorates its kernels at import only when CUDA or TRITON_INTERPRET is present
(otherwise on first use), so setting the variable here, before any kernel is used, is enough even if
another test module imported specgen first. The conftest belongs to the lead and is left alone.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402

import pytest  # noqa: E402

from specgen.kernels import keyed_noise as kn  # noqa: E402
from specgen.kernels import launch_configs, rejection  # noqa: E402
from specgen.pipelines.verify import verify  # noqa: E402

pytestmark = pytest.mark.skipif(not kn.triton_available(), reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def vocabulary_blocks(block_v: int):
    """The verify kernel launched with BLOCK_V = `block_v` (small vocabularies cross several blocks)."""
    shipped = launch_configs.VERIFY
    launch_configs.VERIFY = dataclasses.replace(shipped, tiles={"BLOCK_V": block_v})
    try:
        yield
    finally:
        launch_configs.VERIFY = shipped


@pytest.mark.parametrize("stream", [kn.TARGET, kn.DRAFT, kn.ACCEPT, kn.RESIDUAL])
def test_noise_bits_identical_in_triton_and_torch(stream):
    g = torch.Generator().manual_seed(stream)
    B, T, V = 3, 4, 300
    key = torch.randint(0, 2**32, (B,), generator=g)
    key[0] = 0
    key[1] = 2**32 - 1
    positions = torch.randint(0, 2**40, (B, T), generator=g)  # beyond 2**32: both take it mod 2**32
    positions[0, 0] = 0
    key, positions = key.to(DEVICE), positions.to(DEVICE)
    bits, u = kn.noise_bits_triton(key, positions, V, stream, block_v=64)
    ref = kn.noise_bits(key, positions, torch.arange(V, device=DEVICE), stream)
    assert torch.equal(bits, ref)
    assert torch.equal(u, kn.bits_to_uniform(ref))  # exact arithmetic on both sides
    assert (u > 0).all() and (u < 1).all()


def _case(B: int, K: int, V: int, greedy_mode: str, stochastic: bool, seed: int):
    """Random inputs whose drafts are partly the reference's own samples, so acceptance varies."""
    g = torch.Generator().manual_seed(seed)
    logprobs = (torch.randn(B, K + 1, V, generator=g) * 2).log_softmax(-1)
    logprobs[:, :, V // 3] = float("-inf")  # as after top-k / top-p: zero-probability tokens
    greedy = {
        "greedy": torch.ones(B, dtype=torch.bool),
        "sampled": torch.zeros(B, dtype=torch.bool),
        "mixed": torch.arange(B) % 2 == 1,
    }[greedy_mode]
    key = torch.randint(0, 2**32, (B,), generator=g)
    positions = (torch.randint(0, 5000, (B, 1), generator=g) + torch.arange(K + 1)).contiguous()
    plain = rejection.sample_rows(logprobs, greedy, key, positions)
    drafts = plain[:, :K].clone()
    corrupt = torch.rand(B, K, generator=g) < 0.3
    drafts = torch.where(corrupt, torch.randint(0, V, (B, K), generator=g), drafts)
    draft_probs = None
    if stochastic:
        # a draft distribution near p, so that accept tests go both ways
        draft_probs = (logprobs[:, :K] + torch.randn(B, K, V, generator=g)).softmax(-1).contiguous()
    args = (logprobs, drafts, draft_probs, greedy, key, positions)
    return tuple(a.to(DEVICE) if a is not None else None for a in args)


# Small grid: B in {1, 3, 5}, K in {0, 1, 4}, V in {37, 300} (not multiples of BLOCK_V), two BLOCK_Vs,
# greedy / sampled / mixed rows, one-hot and stochastic drafts. B and the row mode rotate so that each
# (K, V, BLOCK_V, draft type) pair is run once: the interpreter is slow.
GRID = [
    (B, K, V, block_v, mode, stochastic, n)
    for n, (K, V, block_v, stochastic) in enumerate(itertools.product([0, 1, 4], [37, 300], [16, 128], [False, True]))
    for B, mode in [([1, 3, 5][n % 3], ["mixed", "sampled", "greedy"][n // 2 % 3])]
]


@pytest.mark.parametrize("B,K,V,block_v,mode,stochastic,seed", GRID)
def test_kernel_matches_reference(B, K, V, block_v, mode, stochastic, seed):
    args = _case(B, K, V, mode, stochastic, seed=seed)
    acc_ref, em_ref, relaxed_ref = rejection.verify_reference(*args)
    acc, em, relaxed = _verify(args, block_v)
    assert torch.equal(acc, acc_ref)
    assert torch.equal(em, em_ref)
    assert not relaxed.any() and not relaxed_ref.any()     # no relaxed mask: nothing counted


def _verify(args, block_v):
    with vocabulary_blocks(block_v):
        return rejection.verify_triton(*args)


def test_kernel_covers_every_acceptance_length():
    # one larger batch: all lengths 0..K occur, in both draft types, and kernel == reference
    for stochastic in (False, True):
        args = _case(24, 4, 37, "mixed", stochastic, seed=7)
        acc_ref, em_ref, _ = rejection.verify_reference(*args)
        acc, em, _ = _verify(args, 32)
        assert torch.equal(acc, acc_ref) and torch.equal(em, em_ref)
        assert set(acc.tolist()) == set(range(5))


def test_kernel_residual_fallback():
    # draft outside p's support (rejected) with q >= p everywhere: the residual is zero, emit y
    B, K, V = 3, 2, 40
    logprobs, _, _, greedy, key, positions = _case(B, K, V, "sampled", False, seed=8)
    drafts = torch.full((B, K), V // 3, dtype=torch.int64, device=DEVICE)  # a -inf token
    big_q = (logprobs[:, :K].exp() * 1.5).contiguous()
    args = (logprobs, drafts, big_q, greedy, key, positions)
    acc, em, _ = _verify(args, 16)
    acc_ref, em_ref, _ = rejection.verify_reference(*args)
    assert torch.equal(acc, acc_ref) and torch.equal(em, em_ref)
    assert acc.tolist() == [0] * B
    assert torch.equal(em[:, 0], rejection.sample_rows(logprobs, greedy, key, positions)[:, 0])


def test_verify_dispatch_forces_kernel():
    args = _case(3, 2, 37, "mixed", True, seed=9)
    kernel = verify(*args, force_kernel=True)
    reference = verify(*args, force_kernel=False)
    assert torch.equal(kernel[0], reference[0]) and torch.equal(kernel[1], reference[1])
    # K = 0 from slices (views, not contiguous): verify() densifies them for the kernel
    logprobs, drafts, _, greedy, key, positions = args
    plain = (logprobs[:, :1], drafts[:, :0], None, greedy, key, positions[:, :1])
    assert not plain[0].is_contiguous()
    kernel = verify(*plain, force_kernel=True)
    reference = verify(*plain, force_kernel=False)
    assert torch.equal(kernel[1], reference[1]) and kernel[1].shape == (3, 1)


def test_wrapper_rejects_bad_inputs():
    logprobs, drafts, probs, greedy, key, positions = _case(2, 2, 37, "sampled", True, seed=10)
    good = dict(logprobs=logprobs, draft_tokens=drafts, draft_probs=probs, greedy=greedy, noise_key=key,
                positions=positions)
    bad = [
        dict(logprobs=logprobs.double()),
        dict(logprobs=logprobs.transpose(0, 1).contiguous().transpose(0, 1)),  # not contiguous
        dict(draft_tokens=drafts.int()),
        dict(draft_tokens=drafts[:, :1]),
        dict(draft_probs=probs.half()),
        dict(draft_probs=probs[:, :, :-1]),
        dict(greedy=greedy.long()),
        dict(noise_key=key[:1]),
        dict(positions=positions[:, :2]),
    ]
    for change in bad:
        with pytest.raises(AssertionError):
            rejection.verify_triton(**(good | change))
