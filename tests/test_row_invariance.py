"""Row invariance on CPU: what makes speculative output the very tokens of plain decoding.

A token verified beside k drafts must get the logits plain decoding computes for it alone, and a
prompt's cache and first token must not depend on which prompts were admitted beside it; else
greedy and seeded output part from plain decoding at near ties, more often in bf16 (issue 68).
Checked here, bit for bit:
- the kernel of eager steps' products (kernels/cpu_linear.py): against its float64 reference, and
  each row alone, in other company, at another place and on another number of threads;
- an eager step of T rows per slot against the plain step (T = 1): the first row's logits, for a
  Llama and an MLA (DeepSeek-V3) target, float32 and bf16, over 1 and 3 slots, 1 and 2 threads;
- the prefill: one prompt alone against the same prompt beside others of other lengths.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import tiny_llama_config, write_llama_checkpoint
from checkpoints_deepseek import tiny_deepseek_config, write_deepseek_checkpoint

from specgen.checkpoints.loading import load_target
from specgen.kernels import cpu_linear
from specgen.models.products import row_invariant_products
from specgen.pipelines.compiled import StepFunctions
from specgen.pipelines.prefill import PrefillItem, plan_prefill
from specgen.pipelines.runner import Runner
from specgen.pipelines.stops import StopRules
from specgen.pipelines.unified import UnifiedStep
from specgen.sampling import SamplingTensors


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_products_kernel_gives_each_row_the_same_bits_whatever_shares_its_call(dtype, two_threads):
    gen = torch.Generator().manual_seed(0)
    # K = 77: a partial last vector on every CPU; N = 37: a partial last tile of outputs
    weight = torch.randn(37, 77, generator=gen).to(dtype)
    bias = torch.randn(37, generator=gen)
    x = torch.randn(23, 77, generator=gen).to(dtype)
    out = cpu_linear.linear(x, weight, bias, out_dtype=torch.float32)
    reference = cpu_linear.linear_reference(x, weight, bias)
    assert torch.allclose(out.double(), reference, rtol=1e-5, atol=1e-5)
    whole = cpu_linear.linear(x, weight, bias)
    for m in range(1, 23):                                   # fewer rows
        assert torch.equal(cpu_linear.linear(x[:m], weight, bias), whole[:m]), m
    order = torch.randperm(23, generator=gen)                # other places, other neighbours
    assert torch.equal(cpu_linear.linear(x[order], weight, bias), whole[order])
    for threads in (1, 2):
        torch.set_num_threads(threads)
        assert torch.equal(cpu_linear.linear(x, weight, bias), whole), threads


def test_the_grouped_products_are_each_heads_own_product():
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(3, 8, 24, 40, generator=gen)[:, 0]       # [H, N, K], heads strided
    x = torch.randn(5, 2, 3, 40, generator=gen)
    out = cpu_linear.linear(x, weights)
    assert out.shape == (5, 2, 3, 24)
    assert torch.allclose(out.double(), cpu_linear.linear_reference(x, weights), rtol=1e-5, atol=1e-5)
    for h in range(3):
        assert torch.equal(out[..., h, :], cpu_linear.linear(x[..., h, :].contiguous(), weights[h].contiguous()))


# -------------------------------------------------------------------------------------------- step


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance")
    return {"llama": write_llama_checkpoint(root / "llama", tiny_llama_config()),
            "deepseek": write_deepseek_checkpoint(root / "deepseek", tiny_deepseek_config())}


def _target(folder, dtype):
    import json

    config = json.loads((folder / "config.json").read_text())
    return load_target(config, folder, dtype=dtype, device="cpu", dummy=False)


class _Logits:
    """Records every logits tensor the target's head returns."""

    def __init__(self, target) -> None:
        self.seen, head = [], target.logits
        target.logits = lambda hidden: self.seen.append(head(hidden)) or self.seen[-1]


def _step_logits(target, slots: int, t: int, threads: int) -> torch.Tensor:
    """The head's logits of an eager verify of t rows per slot, from one fixed state: [slots, t, V]."""
    torch.set_num_threads(threads)
    step = UnifiedStep(target, None, host_k=3)
    state = step.new_state(slots, "cpu", torch.float32)
    caches = step.new_caches(slots, 64, next(target.parameters()).dtype, "cpu")
    for slot in range(slots):                    # slot b's history (20 positions) whatever the slots
        gen = torch.Generator().manual_seed(5 + slot)
        for cache in caches.target.tensors():
            cache[slot] = torch.randn(cache.shape[1:], generator=gen).to(cache.dtype)
        state.pending[slot] = torch.randint(3, target.vocab_size, state.pending.shape[1:], generator=gen)
    state.cache_lens.fill_(20)
    state.limit.fill_(60)
    state.active.fill_(True)
    sampling = SamplingTensors.build([0.0] * slots, [0] * slots, [1.0] * slots, [0.0] * slots, "cpu")
    functions = StepFunctions(step, state, caches, sampling, device=torch.device("cpu"), compile=False)
    recorder = _Logits(target)
    try:
        functions.verify(40, t)
    finally:
        del target.logits
    return recorder.seen[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_an_eager_step_verifies_a_token_with_the_logits_of_plain_decoding(targets, arch, dtype, two_threads):
    """The first row of a verify of k + 1 rows per slot has the plain step's logits, bit for bit,
    over 1 and 3 slots and on 1 and 2 threads (the plain step on 1 slot, 1 thread is the reference)."""
    target = _target(targets[arch], dtype)
    plain = _step_logits(target, 1, 1, threads=1)[:, 0]
    for slots in (1, 3):
        for t in (1, 2, 4):
            for threads in (1, 2):
                rows = _step_logits(target, slots, t, threads)
                assert torch.equal(rows[:1, 0], plain), (slots, t, threads)


def test_without_the_invariant_products_an_eager_float32_step_would_part_from_plain_decoding(targets):
    """The control: the BLAS's products give the first row other bits beside more rows (else the test
    above could not fail on this machine). Where this CPU's BLAS happens to be row-invariant the
    control has nothing to show and is skipped."""
    target = _target(targets["llama"], torch.float32)
    x = torch.randn(4, target.hidden_size)
    head = target.lm_head.weight
    if torch.equal(torch.nn.functional.linear(x[:1], head), torch.nn.functional.linear(x, head)[:1]):
        pytest.skip("this CPU's BLAS gives one row the same bits as four")
    with row_invariant_products():
        assert torch.equal(target.logits(x[:1]), target.logits(x)[:1])


# ----------------------------------------------------------------------------------------- prefill


def _prefilled(target, prompts: list[list[int]], slot_of_first: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Prefill `prompts` in one admission (the first into `slot_of_first`, the others around it);
    returns the first prompt's cache entries (each layer's keys and values of its positions) and the
    logits its first token was sampled from."""
    step = UnifiedStep(target, None)
    runner = Runner(step, batch_size=len(prompts), max_seq_len=96, rules=StopRules(frozenset(), (), True, str),
                    sampling=SamplingTensors.build([0.0] * len(prompts), [0] * len(prompts), [1.0] * len(prompts),
                                                   [0.0] * len(prompts), "cpu"),
                    seed=0, device=torch.device("cpu"), dtype=next(target.parameters()).dtype)
    slots = [slot_of_first] + [b for b in range(len(prompts)) if b != slot_of_first]
    items = [PrefillItem(b, p, 0, len(p) + 8) for b, p in zip(slots, prompts)]
    calls = plan_prefill(items, chunk=runner.prefill.chunk, budget=runner.prefill.budget, alone=True)
    assert [call.items[0].slot for call in calls] == slots     # a call per prompt, in admission order
    recorder = _Logits(target)
    try:
        runner.prefill.items(items)
    finally:
        del target.logits
    n = len(prompts[0])
    first = recorder.seen[0]                  # the head reads one row per call: the first token's
    entries = [t[slot_of_first, ..., :n, :].clone() for t in runner.caches.target.tensors()]
    return entries, first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "deepseek"])
def test_a_prompt_prefills_to_the_same_bits_alone_and_beside_others(targets, arch, dtype):
    target = _target(targets[arch], dtype)
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(3, target.vocab_size, (21,), generator=gen).tolist()
    others = [torch.randint(3, target.vocab_size, (n,), generator=gen).tolist() for n in (5, 40, 19)]
    alone_cache, alone_logits = _prefilled(target, [prompt], 0)
    beside_cache, beside_logits = _prefilled(target, [prompt, *others], 2)
    assert torch.equal(alone_logits, beside_logits)
    for alone, beside in zip(alone_cache, beside_cache, strict=True):
        assert torch.equal(alone, beside)
