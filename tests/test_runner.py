"""The batch loop: batched and chunked prefill, the lagged (overlapped) host loop, refills, and the
cache bounds at max_seq_len. Every variant must emit exactly the tokens of the simplest one."""

from __future__ import annotations

import pytest
import torch
from test_speculative import make_recipe, models, oracle_for, prompts, run, runner_for  # noqa: F401

from specgen.models.attention import KVCache
from specgen.pipelines.prefill import PrefillItem, pack, plan_prefill
from specgen.pipelines.requests import Request
from specgen.pipelines.runner import Runner
from specgen.pipelines.stops import StopRules
from specgen.pipelines.unified import UnifiedStep


def variant(runner: Runner, draft=None, **changes) -> Runner:
    """The same target, draft and settings, with some Runner arguments changed."""
    step = runner.unified if draft is None else UnifiedStep(runner.unified.target, draft)
    args = dict(batch_size=runner.batch_size, max_seq_len=runner.max_seq_len, rules=runner.rules,
                sampling=runner.sampling, seed=runner.seed, device=runner.device, dtype=torch.float32)
    args.update(changes)
    return Runner(step, **args)


# ------------------------------------------------------------------------------------- prefill plan


def test_plan_groups_by_length_within_the_budget_and_chunks_long_prompts():
    items = [PrefillItem(slot, [1] * n, 0, 100) for slot, n in enumerate([5, 70, 20, 33, 3])]
    calls = plan_prefill(items, chunk=32, budget=64)
    # sorted by length 3, 5 | 20, 33 | 70: padded widths (multiples of 16, at most one chunk) times
    # rows stay within 64 tokens; 33 and 70 go on in further chunks of 32
    assert [[i.slot for i in c.items] for c in calls] == [[4, 0], [2, 3], [3], [1], [1], [1]]
    assert [(c.start, c.width) for c in calls] == [(0, 16), (0, 32), (32, 16), (0, 32), (32, 32), (64, 16)]
    assert all(len(c.items) * c.width <= 64 for c in calls)


def test_pack_lays_out_tokens_positions_and_the_next_tokens():
    items = [PrefillItem(3, [10, 11, 12, 13, 14], 77, 9), PrefillItem(1, [20, 21], 78, 6)]
    call, = plan_prefill(items, chunk=16, budget=64)
    batch = pack(call, alloc_len=32, key_index=torch.arange(32), device=torch.device("cpu"))
    assert batch.rows.tolist() == [1, 3]                           # shortest first
    assert batch.tokens[1, :6].tolist() == [10, 11, 12, 13, 14, 0]
    assert batch.next_tokens[1, :5].tolist() == [11, 12, 13, 14, 0]
    assert batch.last_index.tolist() == [1, 4] and batch.is_last.tolist() == [True, True]
    assert batch.positions[0, :3].tolist() == [0, 1, 2] and batch.noise_key.tolist() == [78, 77]
    long = [PrefillItem(0, list(range(40)), 1, 50)]
    calls = plan_prefill(long, chunk=16, budget=64)
    assert [(c.start, c.width) for c in calls] == [(0, 16), (16, 16), (32, 16)]
    middle = pack(calls[1], alloc_len=64, key_index=torch.arange(64), device=torch.device("cpu"))
    assert middle.tokens[0].tolist() == list(range(16, 32)) and not bool(middle.is_last[0])
    assert middle.next_tokens[0, -1].item() == 32                  # the next chunk's first token
    last = pack(calls[2], alloc_len=64, key_index=torch.arange(64), device=torch.device("cpu"))
    assert last.last_index.tolist() == [7] and bool(last.is_last[0])


# ------------------------------------------------------------------------------ same tokens, always


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "sampled"])
def test_batched_chunked_and_overlapped_runs_equal_one_at_a_time(models, sampling):
    target, draft = models
    ids = prompts(lengths=(3, 41, 6, 17, 1, 30, 8, 25))
    base = runner_for(make_recipe(target, draft, k=3, batch=1, **sampling))
    reference, _ = run(base, ids)
    batched = runner_for(make_recipe(target, draft, k=3, batch=4, **sampling))
    assert run(batched, ids)[0] == reference
    for changes in ({"prefill_chunk": 16}, {"overlap": True}, {"overlap": True, "prefill_chunk": 16,
                                                               "prefill_budget": 32}):
        runner = variant(batched, **changes)
        got, totals = run(runner, ids)
        assert got == reference, changes
        assert totals.requests == len(ids)
    assert variant(batched, prefill_chunk=16).prefill.chunk == 16


def test_overlapped_loop_with_stops_refills_and_the_oracle(models):
    """The lagged host loop: slots finish by EOS-like stops mid-block and are refilled while the next
    step is already issued; every acceptance length happens (oracle draft)."""
    target, draft = models
    ids = prompts()
    plain, _ = run(runner_for(make_recipe(target)), ids)
    base = runner_for(make_recipe(target, draft, k=3, batch=2))
    oracle = oracle_for(ids, plain, 3)
    lagged, totals = run(variant(base, oracle, overlap=True), ids)
    assert lagged == plain
    assert totals.spec.acceptance_histogram[0] > 0 and totals.spec.acceptance_histogram[3] > 0
    # stops: finish each request at its 5th token (a stop id), slots refill under the lag
    stop_ids = frozenset(t[4] for t in plain.values())
    rules = StopRules(stop_ids, (), False, lambda ids: "")
    stopped, _ = run(variant(base, oracle_for(ids, plain, 3), overlap=True, rules=rules), ids)
    eager, _ = run(variant(base, oracle_for(ids, plain, 3), rules=rules), ids)
    assert stopped == eager
    assert all(len(v) <= 5 for v in stopped.values())


@pytest.mark.parametrize("k", [4, 6])
def test_no_cache_write_falls_past_the_allocation_at_max_seq_len(models, k, monkeypatch):
    """Prompts that nearly fill max_seq_len, max_tokens cut inside accepted blocks, inactive slots, and
    the lagged loop: every K/V write stays inside the slot's allocation."""
    target, draft = models
    writes = []
    original = KVCache.write

    def checked(self, layer, rows, positions, k_new, v_new):
        writes.append(int(positions.max()))
        assert int(positions.max()) < self.max_len and int(positions.min()) >= 0
        return original(self, layer, rows, positions, k_new, v_new)

    monkeypatch.setattr(KVCache, "write", checked)
    recipe = make_recipe(target, draft, k=k, batch=3)
    base = runner_for(recipe)
    plain = runner_for(make_recipe(target, batch=3))
    max_seq_len = base.max_seq_len
    lengths = (max_seq_len - 2, max_seq_len - 7, 5, max_seq_len - 1 - k)
    ids = prompts(lengths=lengths)
    expected, _ = run(plain, ids, max_tokens=40)
    oracle = oracle_for(ids, expected, k)
    got, totals = run(variant(base, oracle, overlap=True), ids, max_tokens=40)
    assert got == expected
    assert max(writes) >= max_seq_len - 1           # the bound was really approached
    assert all(len(got[f"p{i}"]) == min(40, max_seq_len - n) for i, n in enumerate(lengths))


def test_token_ids_outside_the_vocabulary_are_refused_on_the_host_before_prefill(models):
    # on CUDA such an id is a device-side assert that ends the process: no kernel may ever see it
    target, _ = models
    runner = runner_for(make_recipe(target, batch=3))
    vocab = runner.unified.target.vocab_size
    prefilled = []
    original = runner.functions.prefill

    def spy(batch, *rest):
        prefilled.append(batch.tokens.clone())
        return original(batch, *rest)

    runner.functions.prefill = spy
    good = prompts(lengths=(4, 6))
    requests = [Request("a", good[0], 8, 1), Request("big", [5, vocab, 7], 8, 2),
                Request("negative", [-1, 5], 8, 3), Request("b", good[1], 8, 4)]
    done = {}
    runner.run(requests, lambda c: done.__setitem__(c.id, c))
    assert done["big"].finish_reason == "error"
    assert done["big"].error == f"prompt token 1 has id {vocab}, outside the target's vocabulary (0..{vocab - 1})"
    assert done["negative"].error.startswith("prompt token 0 has id -1, outside")
    assert len(done["a"].token_ids) == 8 and len(done["b"].token_ids) == 8
    assert prefilled and all(int(t.min()) >= 0 and int(t.max()) < vocab for t in prefilled)


def test_a_prompt_that_fails_in_prefill_is_an_error_and_the_batch_goes_on(models):
    target, _ = models
    runner = runner_for(make_recipe(target, batch=3))
    original = runner.functions.prefill
    poison = 7

    def failing(batch, *rest):     # a prefill that raises on one prompt (ids valid: the host check passes)
        if bool((batch.tokens == poison).any()):
            raise RuntimeError("simulated kernel failure")
        return original(batch, *rest)

    runner.functions.prefill = failing
    good = [[t if t != poison else poison + 1 for t in p] for p in prompts(lengths=(4, 6))]
    requests = [Request("a", good[0], 8, 1), Request("bad", [5, poison, 6], 8, 2), Request("b", good[1], 8, 3)]
    done = {}
    runner.run(requests, lambda c: done.__setitem__(c.id, c))
    assert done["bad"].finish_reason == "error"
    assert done["bad"].error == "prefill failed: RuntimeError: simulated kernel failure"
    assert len(done["a"].token_ids) == 8 and len(done["b"].token_ids) == 8


def test_plan_keeps_prompts_of_very_different_lengths_apart():
    items = [PrefillItem(0, [1] * 16, 0, 50), PrefillItem(1, [1] * 200, 0, 300), PrefillItem(2, [1] * 190, 0, 300)]
    calls = plan_prefill(items, chunk=512, budget=4096)
    assert [[i.slot for i in c.items] for c in calls] == [[0], [2, 1]]   # 190 and 200 pad little together


def test_the_tail_of_a_run_steps_over_fewer_slots_and_loses_nothing(models):
    """Once no request is left to admit and at most half the slots are live, they move to the lowest
    slots and the (eager) step runs over those only; tokens are exactly those of batch 1."""
    target, draft = models
    ids = prompts(lengths=(3, 41, 6, 17, 1, 30, 8, 25))
    lengths = [4, 30, 6, 22, 9, 3, 28, 12]           # ragged max_tokens: the batch drains unevenly
    reference = {}
    single = runner_for(make_recipe(target, draft, k=3, batch=1))
    single.run([Request(f"p{i}", p, n, 1000 + i) for i, (p, n) in enumerate(zip(ids, lengths))],
               lambda c: reference.__setitem__(c.id, c.token_ids))
    runner = runner_for(make_recipe(target, draft, k=3, batch=4))
    widths = []
    original = runner.functions.use_slots

    def watch(slots):
        widths.append(slots)
        original(slots)

    runner.functions.use_slots = watch
    for run_number in range(2):                       # a second run starts wide again
        got = {}
        runner.run([Request(f"p{i}", p, n, 1000 + i) for i, (p, n) in enumerate(zip(ids, lengths))],
                   lambda c: got.__setitem__(c.id, c.token_ids))
        assert got == reference
        assert (widths[0] == 4) == bool(run_number)  # a later run starts from all slots again
        narrowed = widths[1:] if run_number else widths
        assert narrowed[-1] == 1 and narrowed == sorted(narrowed, reverse=True) and max(narrowed) < 4
        widths.clear()


def test_step_seconds_leave_the_prefill_out(models, monkeypatch):
    """`RunTotals.step_seconds` is what the steps cost (bench's step_ms): admission is not in it. A
    prefill made 0.2 s slower moves the whole 0.2 s per call out of it."""
    import time

    target, draft = models
    runner = runner_for(make_recipe(target, draft, batch=2))
    calls = []
    prefill = runner.functions.prefill

    def slow_prefill(batch, *rest):
        calls.append(batch)
        time.sleep(0.2)
        return prefill(batch, *rest)

    monkeypatch.setattr(runner.functions, "prefill", slow_prefill)
    _, totals = run(runner, prompts(lengths=(5, 7, 9)), max_tokens=6)
    assert calls and totals.steps > 0 and totals.step_seconds > 0
    assert totals.step_seconds <= totals.wall_seconds - 0.2 * len(calls)
