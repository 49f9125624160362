"""Choosing k per step: the policy's decisions, and outputs that stay the target's whatever k does.

- `AdaptivePolicy` on its own (host arithmetic, no model): plain steps when drafts never accept, the
  largest k when they always do, a variant compiled only when the rest of the job repays it, probes
  that back off while plain decoding wins.
- The real runner with a scripted k (0 <-> k > 0 mid-request, every draft method): greedy and seeded
  sampled outputs equal plain decoding, and after plain steps the draft's cache holds what it would
  have held had it drafted all along (it caught up on the positions it skipped).
- `num_speculative_tokens: auto` end to end, with step costs pinned so that the test never depends
  on the machine's speed.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint
from checkpoints_dflash import tiny_dflash_config, write_dflash_checkpoint
from test_mtp import write_mtp_target
from test_speculative import never_wrong, oracle_for, prompts, run

from specgen.job import build_runner, resolve
from specgen.pipelines.policy import FIRST_PROBE_INTERVAL, AdaptivePolicy, FixedPolicy, SlotView, per_position_prior
from specgen.pipelines.runner import Runner
from specgen.pipelines.unified import UnifiedStep
from specgen.recipe import recipe_from_dict

# ------------------------------------------------------------------------------- the policy alone

WIDTH = 4
SLOTS = [SlotView(b, 10_000) for b in range(WIDTH)]


def policy_with(costs: dict[int, float], k_max: int = 3, prior: float = 0.5, **kw) -> AdaptivePolicy:
    policy = AdaptivePolicy(k_max, [prior] * k_max, **kw)
    for k, seconds in costs.items():
        policy.set_cost(k, WIDTH, seconds)
    return policy


def drive(policy: AdaptivePolicy, accepts, steps: int, available=frozenset({1, 2, 3})) -> list[int]:
    """`steps` decisions; every slot accepts `accepts(k)` of the k drafted."""
    choices = []
    for _ in range(steps):
        k = policy.choose(SLOTS, set(available), WIDTH)
        choices.append(k)
        for b in range(WIDTH):
            policy.observe_block(b, k, accepts(k))
    return choices


CPU_LIKE = {0: 0.040, 1: 0.043, 2: 0.046, 3: 0.049}      # verifying k + 1 rows costs little more


def test_plain_steps_when_drafts_never_accept():
    choices = drive(policy_with(CPU_LIKE), lambda k: 0, 400)
    late = choices[-200:]
    assert late.count(0) >= 0.92 * len(late)          # only the probes draft (two steps each)
    assert 0 < sum(k > 0 for k in late)                # ... and they still happen


def test_largest_k_when_drafts_always_accept():
    choices = drive(policy_with(CPU_LIKE, prior=0.1), lambda k: k, 200)
    assert choices[-100:].count(3) >= 95


def test_the_right_k_follows_the_cost_of_verifying_more_rows():
    # acceptance 0.6 everywhere; when a step's cost grows with its rows (a GPU at large batch) fewer
    # drafts win than when verifying more rows is almost free (a CPU at batch 1)
    # E(k) = 1, 1.6, 1.96, 2.18 tokens per step
    assert drive(policy_with(CPU_LIKE, prior=0.6), lambda k: 0, 1)[0] == 3
    assert drive(policy_with({k: 0.04 * (1 + 0.5 * k) for k in range(4)}, prior=0.6), lambda k: 0, 1)[0] == 1
    assert drive(policy_with({k: 0.04 * (1 + k) for k in range(4)}, prior=0.6), lambda k: 0, 1)[0] == 0


def test_a_variant_is_compiled_only_when_the_job_repays_it():
    # k = 3 would triple throughput, but compiling it takes 100 s
    costs = {0: 0.040, 3: 0.050}

    def decide(horizon: int) -> int:
        policy = policy_with(costs, prior=0.99, horizon_tokens=horizon, compile_estimate={3: 100.0})
        return policy.choose(SLOTS, set(), WIDTH)

    assert decide(1_000) == 0               # saves ~7 s: not worth 100 s of compiling
    assert decide(1_000_000) == 3


def test_probes_back_off_while_plain_decoding_wins():
    policy = policy_with(CPU_LIKE, max_interval=32)
    choices = drive(policy, lambda k: 0, 600)
    # a probe is two drafting steps (the catch-up, then a timed one): count where each begins. A
    # single drafting step is a slot whose evidence faded back to the job's estimate, which the card
    # keeps above break-even for the first few dozen blocks; none once the job has seen enough.
    starts = [i for i in range(1, len(choices) - 1) if choices[i] > 0 and choices[i - 1] == 0]
    probes = [i for i in starts if choices[i + 1] > 0]
    assert not [i for i in starts if choices[i + 1] == 0 and i > 150]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] < gaps[-1] and max(gaps) <= 33


def test_one_odd_step_does_not_move_a_cost():
    # the first plain step of a run took 1.5x its profiled time (a demo job then stayed on k = 1):
    # the pace moves a little, every variant with it, and no variant's cost against another's
    policy = policy_with(CPU_LIKE, prior=0.0)
    policy.observe_step(0, WIDTH, 1.5 * CPU_LIKE[0])
    assert policy.cost(0, WIDTH) / policy.cost(1, WIDTH) == pytest.approx(CPU_LIKE[0] / CPU_LIKE[1])
    assert policy.cost(0, WIDTH) < 1.1 * CPU_LIKE[0]
    assert drive(policy, lambda k: 0, 1) == [0]


def test_a_slow_spell_of_the_machine_does_not_make_the_variant_it_hit_look_dear():
    # k = 1 pays (acceptance 0.5: 1.5 tokens for 1.075x the cost); then the machine runs 40% slower
    # while k = 1 steps run, and a probe down times a plain step in the same spell: k = 1 still wins.
    # (Timed without the pace, k = 1 at 1.4 x 43 ms would lose to plain steps' profiled 40 ms.)
    policy = policy_with(CPU_LIKE, k_max=1, prior=0.5)
    slow = 1.0
    choices = []
    for step in range(200):
        if step == 50:
            slow = 1.4
        k = policy.choose(SLOTS, {1}, WIDTH)
        choices.append(k)
        policy.observe_step(k, WIDTH, slow * CPU_LIKE[k])
        for b in range(WIDTH):
            policy.observe_block(b, k, step % 2 if k else 0)
    assert choices[-100:].count(1) >= 90
    assert policy.cost(1, WIDTH) / policy.cost(0, WIDTH) == pytest.approx(CPU_LIKE[1] / CPU_LIKE[0], rel=0.03)
    assert policy.cost(0, WIDTH) == pytest.approx(1.4 * CPU_LIKE[0], rel=0.05)


def test_no_probe_up_once_the_next_position_cannot_win():
    # k = 1 wins (position 1 accepts 60%); position 2 never accepts and a step of 2 drafts costs 1.3x
    # a step of 1: probes up stop once the job has seen enough of position 2, and the probe interval
    # grows while probes leave the choice at k = 1
    policy = policy_with({0: 0.040, 1: 0.042, 2: 0.055}, k_max=2, prior=0.6)
    choices, rng = [], itertools.cycle([1, 1, 1, 0, 0])
    for _ in range(600):
        k = policy.choose(SLOTS, {1, 2}, WIDTH)
        choices.append(k)
        for b in range(WIDTH):
            policy.observe_block(b, k, min(k, next(rng)))
    ups = [i for i, k in enumerate(choices) if k == 2]
    assert choices[-100:].count(1) >= 95
    assert ups and ups[-1] < 300, ups
    assert policy.probe_interval > 8


def test_a_stale_plain_cost_is_measured_again_by_probes():
    # plain decoding profiled at 60 ms but really 40; the draft never agrees, so k = 1 (43 ms) looks
    # better until probes down measure plain steps again
    policy = policy_with({**CPU_LIKE, 0: 0.060}, prior=0.0)
    choices = []
    for _ in range(300):
        k = policy.choose(SLOTS, {1, 2, 3}, WIDTH)
        choices.append(k)
        policy.observe_step(k, WIDTH, CPU_LIKE[k])
        for b in range(WIDTH):
            policy.observe_block(b, k, 0)
    assert choices[0] == 1 and choices[-100:].count(0) >= 90


def test_a_width_never_measured_keeps_the_variants_ratio():
    # at 16 slots a k = 1 step costs 1.5x a plain one; a run's tail narrows to 4 slots where only plain
    # steps were timed: k = 1 there is estimated at 1.5x that plain step, and with position 1
    # accepting 30% (1.3 tokens for 1.5x the time) the narrowed steps stay plain
    policy = AdaptivePolicy(1, [0.3])
    policy.set_cost(0, 16, 0.040)
    policy.set_cost(1, 16, 0.060)
    policy.set_cost(0, 4, 0.015)
    assert policy.cost(1, 4) == pytest.approx(0.0225)
    assert policy.choose([SlotView(b, 10_000) for b in range(4)], {1}, 4) == 0


def test_a_variant_compiled_after_an_estimate_is_timed_before_it_is_judged():
    # k = 1 was estimated from its eager time at 60 ms (plain steps: 40): on that estimate it never
    # wins, so nothing would ever time it. Once it runs without compiling, steps take it until three
    # are timed (the first at 70 ms, an odd one): 42 ms, and with position 1 accepting half the time
    # it wins from then on.
    policy = AdaptivePolicy(1, [0.5])
    policy.set_cost(0, WIDTH, 0.040)
    policy.set_cost(1, WIDTH, 0.060, estimated=True)
    assert policy.choose(SLOTS, set(), WIDTH) == 0
    choices = time_an_estimated_k1(policy, {0: 0.040, 1: 0.042}, 0.070, lambda step, b: b % 2, 50)
    assert choices[:3] == [1, 1, 1] and choices[-40:].count(1) >= 38


def time_an_estimated_k1(policy: AdaptivePolicy, seconds: dict[int, float], first: float, accepted,
                         steps: int) -> list[int]:
    """Steps once k = 1 runs without compiling: its first timed step takes `first`, the others
    `seconds`; slot b accepts `accepted(step, b)` of a k = 1 block."""
    choices = []
    for step in range(steps):
        k = policy.choose(SLOTS, {1}, WIDTH)
        choices.append(k)
        policy.observe_step(k, WIDTH, first if k and choices.count(1) == 1 else seconds[k])
        for b in range(WIDTH):
            policy.observe_block(b, k, k and accepted(step, b))
    return choices


def test_an_odd_first_timed_step_of_an_estimated_variant_is_outvoted():
    # a bench's auto: k = 1, compiled by another configuration, ran its first timed step at 121 ms
    # (5x its next ones, 22-23 ms, against 20 for plain steps). With position 1 accepting 25%, k = 1
    # pays and must win once its next steps are timed.
    policy = AdaptivePolicy(1, [0.25])
    policy.set_cost(0, WIDTH, 0.020)
    policy.set_cost(1, WIDTH, 0.030, estimated=True)
    choices = time_an_estimated_k1(policy, {0: 0.020, 1: 0.0225}, 0.121, lambda step, b: int(step % 4 == 0), 40)
    assert choices[-20:].count(1) >= 18


def run_timed(policy: AdaptivePolicy, step_seconds: dict[int, float], accepted, steps: int) -> list[int]:
    """`steps` decisions (k = 0 or 1) timed as the runner times them: a draft step after plain ones
    catches the draft up and is not timed; slot b accepts `accepted(step, b)` of a k = 1 block."""
    choices, previous = [], 0
    for step in range(steps):
        k = policy.choose(SLOTS, {1}, WIDTH)
        choices.append(k)
        if not (k > 0 and previous == 0):            # a catch-up step is not the variant's cost
            policy.observe_step(k, WIDTH, step_seconds[k])
        for b in range(WIDTH):
            policy.observe_block(b, k, k and accepted(step, b))
        previous = k
    return choices


def test_probes_out_of_plain_steps_keep_the_variants_cost_measured():
    # k = 1 was once timed at 60 ms (one slow step) against 40 for plain steps; really it takes 42,
    # and position 1 accepts half the time. A probe's first step catches the draft up (not timed, as
    # the runner does); its second is timed, so k = 1's cost comes down and k = 1 wins.
    policy = AdaptivePolicy(1, [0.5])
    policy.set_cost(0, WIDTH, 0.040)
    policy.set_cost(1, WIDTH, 0.060)
    choices = run_timed(policy, {0: 0.040, 1: 0.042}, lambda step, b: b % 2, 300)
    assert choices[:7].count(1) == 0 and choices[-100:].count(1) >= 95


def draft_runs(choices: list[int]) -> list[tuple[int, int]]:
    """(first step, length) of every run of steps that drafted."""
    runs, start = [], None
    for i, k in enumerate([*choices, 0]):
        if k and start is None:
            start = i
        elif not k and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def test_a_long_job_compiles_a_variant_whose_floor_wins_then_judges_it_on_its_steps():
    # Uncompiled, k = 1 and 2 are estimated from eager times (70 and 90 ms against 40 for plain
    # steps); their floors (the plain step's verify plus their drafts) are 42 and 44 ms. SmolLM2 at
    # one slot: MTP's k = 1 estimated at 37.5 ms ran at 25.4 once compiled, plain steps 20.6.
    def fresh(horizon: int) -> AdaptivePolicy:
        policy = AdaptivePolicy(2, [0.5, 0.5], compile_estimate={1: 100.0, 2: 120.0}, horizon_tokens=horizon)
        policy.set_cost(0, WIDTH, 0.040)
        policy.set_cost(1, WIDTH, 0.070, estimated=True, floor=0.042)
        policy.set_cost(2, WIDTH, 0.090, estimated=True, floor=0.044)
        return policy

    # a job that would not repay four times the compile even at the floor compiles nothing
    short = fresh(50_000)
    assert [short.choose(SLOTS, set(), WIDTH) for _ in range(20)] == [0] * 20
    # a long one tries the fewest drafts first (weighed where a probe could be made) ...
    policy = fresh(10_000_000)
    first = [policy.choose(SLOTS, set(), WIDTH) for _ in range(FIRST_PROBE_INTERVAL)]
    assert first == [0] * (FIRST_PROBE_INTERVAL - 1) + [1] and policy.reason == "compile"
    # ... whose steps, once compiled, take 64 ms (1.6x a plain step: 16 slots on 2 cores): it is
    # judged on them, and the time of k = 1 bounds k = 2's floor, so nothing more is compiled
    choices, previous = [], 0
    for _ in range(300):
        k = policy.choose(SLOTS, {1}, WIDTH)
        assert policy.reason != "compile"
        choices.append(k)
        if not (k > 0 and previous == 0):
            policy.observe_step(k, WIDTH, {0: 0.040, 1: 0.064}[k])
        for b in range(WIDTH):
            policy.observe_block(b, k, k and int(b == 0))        # position 1: 25%
        previous = k
    assert choices[:4] == [1, 1, 1, 1] and choices[4:120].count(1) == 0


def test_a_k_that_cannot_win_is_only_rechecked_ever_more_rarely():
    # a step of 1 draft costs 2x a plain one (8 slots on 2 CPU cores): with position 1 accepting
    # about 30%, not even an optimistic acceptance pays for it, so no probe leaves plain steps. Only
    # rechecks do (a catch-up and a timed step that confirms the cost), the first after 4x
    # max_interval plain steps, each interval twice the last, up to 32x max_interval: well under 1%
    # of the job's steps.
    policy = policy_with({0: 0.040, 1: 0.080}, k_max=1, prior=0.3)
    choices = run_timed(policy, {0: 0.040, 1: 0.080}, lambda step, b: 0, 3000)
    runs = draft_runs(choices)
    assert len(runs) >= 4 and all(length == 2 for _, length in runs)
    starts = [start for start, _ in runs]
    assert starts[0] >= 4 * policy.max_interval - 1
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(later >= min(2 * earlier, 32 * policy.max_interval) - 8 for earlier, later in zip(gaps, gaps[1:]))
    assert choices.count(1) <= 0.005 * len(choices)
    # ... and none where the rest of the job is short beside its cost: 40 ms more per step, twice,
    # against under 50x that in plain steps (4 slots at 100 tok/s: 400 tokens)
    policy = policy_with({0: 0.040, 1: 0.080}, k_max=1, prior=0.3, horizon_tokens=4 * 128 + 350)
    assert run_timed(policy, {0: 0.040, 1: 0.080}, lambda step, b: 0, 200).count(1) == 0


def test_a_k_ruled_out_in_a_slow_spell_is_rechecked_and_wins():
    # MTP on held-out ShareGPT at one slot: k = 1's first three timed steps ran in a slow spell (80 ms
    # against 40 for plain steps); really it takes 42 and position 1 accepts half the time. Ruled
    # out, it never ran again for the rest of that job. A recheck's first timed step, far below that
    # cost, starts the cost over from three fresh steps, and k = 1 wins.
    policy = AdaptivePolicy(1, [0.5])
    policy.set_cost(0, WIDTH, 0.040)
    policy.set_cost(1, WIDTH, 0.060, estimated=True)
    slow = iter([0.080] * 3)
    choices, previous = [], 0
    for step in range(1000):
        k = policy.choose(SLOTS, {1}, WIDTH)
        choices.append(k)
        if not (k > 0 and previous == 0):
            policy.observe_step(k, WIDTH, next(slow, 0.042) if k else 0.040)
        for b in range(WIDTH):
            policy.observe_block(b, k, k and b % 2)
        previous = k
    first_run, recheck = draft_runs(choices)[:2]
    assert first_run == (0, 4)                        # judged on its three slow timed steps: out
    assert choices[4:100].count(1) == 0
    assert recheck[0] >= 4 * policy.max_interval - 1
    assert choices[-300:].count(1) >= 295


def test_a_recheck_near_break_even_restarts_the_cost_and_the_draft_wins():
    # MTP at one slot: position 1 accepts 20%, and once a slow spell of the VM ends a k = 1 step
    # takes 46 ms against 40 for a plain one (1.2 tokens for 1.15x the time: k = 1 pays 4%). In the
    # spell k = 1 steps took 54 ms and it was ruled out. A recheck's 46 ms lies within 15% of 54,
    # which had passed for confirmation at every recheck (auto ran plain for the rest of the job);
    # at 46 ms k = 1 could win, so its cost starts over from fresh steps, and k = 1 wins.
    policy = AdaptivePolicy(1, [0.2])
    policy.set_cost(0, WIDTH, 0.040)
    policy.set_cost(1, WIDTH, 0.060, estimated=True)
    choices, previous = [], 0
    for step in range(3000):
        k = policy.choose(SLOTS, {1}, WIDTH)
        choices.append(k)
        if not (k > 0 and previous == 0):
            policy.observe_step(k, WIDTH, (0.054 if step < 300 else 0.046) if k else 0.040)
        for b in range(WIDTH):
            policy.observe_block(b, k, k and int((step + b) % 5 == 0))
        previous = k
    runs = draft_runs(choices)
    assert runs[0] == (0, 4)                          # judged on its three slow timed steps: out
    assert choices[4:300].count(1) <= 4               # rechecked in the spell: confirmed, still out
    assert choices[-1000:].count(1) >= 950


def test_a_recheck_waits_until_the_drafts_can_catch_up_within_their_window():
    # a catch-up reads at most max_window positions: after a longer plain run, the positions before
    # them would stay unread in the draft's cache for the rest of the request
    policy = policy_with({0: 0.040, 1: 0.080}, k_max=1, prior=0.3, max_window=20, horizon_tokens=10**7)
    far = [SlotView(b, 10_000, unabsorbed=300) for b in range(WIDTH)]
    assert [policy.choose(far, {1}, WIDTH) for _ in range(1000)].count(1) == 0
    near = [SlotView(b, 10_000, unabsorbed=5) for b in range(WIDTH)]
    assert 1 in [policy.choose(near, {1}, WIDTH) for _ in range(2 * policy.max_interval)]


def test_probes_stop_once_a_losing_variant_is_timed():
    # 16 slots on 2 CPU cores: a k = 1 step costs 1.6x a plain one and position 1 accepts 30%
    # (1.3 tokens for 1.6x the time). Probes may time k = 1 (its cost is in doubt until three of its
    # steps are timed); after that only rechecks leave plain decoding for it, ever more rarely.
    policy = policy_with({0: 0.040, 1: 0.064}, k_max=1, prior=0.3)
    accepts = itertools.cycle([1, 0, 0, 1, 0, 0, 0, 1, 0, 0])           # 30%, whatever the step
    choices = run_timed(policy, {0: 0.040, 1: 0.064}, lambda step, b: next(accepts), 1000)
    runs = draft_runs(choices)                 # each a catch-up and a timed step
    assert all(length == 2 for _, length in runs)
    probes = [start for start, _ in runs if start < 100]
    rechecks = [start for start, _ in runs if start >= 100]
    assert 0 < len(probes) <= 4
    assert len(rechecks) <= 3 and all(b - a >= 4 * policy.max_interval for a, b in zip(rechecks, rechecks[1:]))


def test_one_step_at_four_times_its_cost_moves_no_choice():
    # a 16-slot bench: its steps ran 1.5x slower than the warm-up profiled them (the pace takes
    # that), then the first plain step after a k = 1 step took 4x its neighbours. k = 1 (1.6x a plain
    # step, 30% accepted) must still lose.
    policy = policy_with({0: 0.040, 1: 0.064}, k_max=1, prior=0.3)
    for _ in range(60):
        policy.observe_step(0, WIDTH, 0.060)
    policy.observe_step(1, WIDTH, 0.096)
    policy.observe_step(0, WIDTH, 0.240)
    assert policy.cost(1, WIDTH) / policy.cost(0, WIDTH) == pytest.approx(1.6, rel=0.05)
    assert drive(policy, lambda k: 0, 1, available={1}) == [0]


def test_a_slot_that_rejected_for_a_while_drafts_again_after_plain_steps():
    # batch 1, a draft step costs 1.2x a plain one; one prompt's text rejects ten blocks in a row:
    # the job's estimate of position 1 falls to 28% (k = 1 still pays), the slot's own to 13% (it
    # turns to plain steps). Its evidence fades over the plain steps that follow, back to the job's
    # estimate: it drafts again without waiting for a probe.
    slot = [SlotView(0, 10_000)]
    policy = AdaptivePolicy(1, [0.5])
    policy.set_cost(0, 1, 0.040)
    policy.set_cost(1, 1, 0.048)
    policy.admit(0)
    for _ in range(10):
        policy.observe_block(0, 1, 0)
    assert policy.choose(slot, {1}, 1) == 0
    for _ in range(30):
        policy.observe_block(0, 0, 0)
    assert policy.choose(slot, {1}, 1) == 1


def test_per_position_prior_from_acceptance_lengths():
    # a1 = 0.5, a2 = 0.4, a3 = 0.25: L1 = 1.5, L2 = 1.7, L3 = 1.75
    assert per_position_prior({1: 1.5, 2: 1.7, 3: 1.75}) == pytest.approx([0.5, 0.4, 0.25])
    assert per_position_prior({}) == []
    # A card measured at K = 3, 5, 7 only (the shipped DFlash one): every gap gets a common rate
    # that reproduces the card's lengths; it once gave no prior and the job assumed 0.5 per position.
    prior = per_position_prior({3: 1.1534, 5: 1.1553, 7: 1.1553})
    assert len(prior) == 7 and prior[0] == prior[1] == prior[2] == pytest.approx(0.1333, abs=1e-4)

    def length(rates, k):
        total, run = 1.0, 1.0
        for r in rates[:k]:
            run *= r
            total += run
        return total

    for k, expected in ((3, 1.1534), (5, 1.1553), (7, 1.1553)):
        assert length(prior, k) == pytest.approx(expected, abs=1e-6)
    assert per_position_prior({2: 3.0}) == pytest.approx([0.99, 0.99])   # past what rates can give


# ------------------------------------------------------------------- the runner with a scripted k


class ScriptedPolicy(FixedPolicy):
    """k from a fixed cycle, whatever happens (K_max = the largest k in it)."""

    def __init__(self, schedule: list[int]) -> None:
        super().__init__(max(schedule))
        self.cycle = itertools.cycle(schedule)

    def choose(self, *args, **kwargs) -> int:
        return next(self.cycle)


# 0 <-> k > 0 both ways, k up and down, plain runs longer than a block (a real catch-up)
SCHEDULE = [0, 0, 3, 1, 0, 2, 0, 0, 0, 0, 0, 3, 3, 0, 1, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("adaptive")
    config = tiny_llama_config(num_nextn_predict_layers=1)
    target = write_mtp_target(root / "target", config)      # carries an MTP layer for method mtp
    return {
        "target": target,
        "eagle3": write_eagle3_checkpoint(root / "eagle3", tiny_eagle3_config(config), config),
        "dflash": write_dflash_checkpoint(root / "dflash", tiny_dflash_config(config, layers=2, block_size=8)),
    }


def recipe(checkpoints, method: str, k="auto", batch: int = 4, draft_dtype: str = "float32", **sampling):
    # the draft's dtype pinned (auto takes the target's float32); the switching test also runs bf16
    draft = {"method": method, "num_speculative_tokens": k, "dtype": draft_dtype}
    if method in ("eagle3", "dflash"):
        draft["model"] = str(checkpoints[method])
    if method == "none":
        draft = {"method": "none"}
    return recipe_from_dict({
        "target": {"model": str(checkpoints["target"]), "dtype": "float32"}, "draft": draft,
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": batch, "max_seq_len": 128, "compile": False},
        "chat_template": False,
    })


def scripted_runner(checkpoints, method: str, schedule: list[int], *, batch: int = 4, draft=None,
                    draft_dtype: str = "float32", **sampling) -> Runner:
    r = recipe(checkpoints, method, k=max(schedule), batch=batch, draft_dtype=draft_dtype, **sampling)
    base, _, _ = build_runner(r, resolve(r), r.sampling.seed)
    step = base.unified if draft is None else UnifiedStep(base.unified.target, draft)
    return Runner(step, batch_size=base.batch_size, max_seq_len=base.max_seq_len, rules=base.rules,
                  sampling=base.sampling, seed=base.seed, device=base.device, dtype=torch.float32,
                  policy=ScriptedPolicy(schedule))


def plain_outputs(checkpoints, batch: int = 4, **sampling):
    r = recipe(checkpoints, "none", batch=batch, **sampling)
    return run(build_runner(r, resolve(r), r.sampling.seed)[0], prompts())[0]


@pytest.mark.parametrize("method", ["eagle3", "mtp", "dflash"])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft_dtype", ["float32", "bfloat16"])
def test_switching_k_mid_request_keeps_the_output(checkpoints, method, sampling, draft_dtype):
    """A float32 target, its draft in float32 or bf16 (drafts/precision.py): the same output."""
    plain = plain_outputs(checkpoints, **sampling)
    spec, totals = run(scripted_runner(checkpoints, method, SCHEDULE, draft_dtype=draft_dtype, **sampling),
                       prompts())
    assert spec == plain
    assert totals.k_steps[0] > 0 and sum(totals.k_steps[1:]) > 0 and totals.spec.num_drafts > 0


def test_switching_k_reads_each_steps_outputs_through_the_cuda_ring_of_buffers(checkpoints):
    """On CUDA the step's outputs reach the host through a ring of buffers sized for K drafts; a
    step of fewer drafts (auto's plain steps) is narrower. The ring's logic, run here on CPU."""
    from specgen.pipelines.host_reader import HostReader

    plain = plain_outputs(checkpoints)
    runner = scripted_runner(checkpoints, "eagle3", SCHEDULE)
    runner.reader = HostReader(runner.device, (runner.batch_size, runner.unified.k + 4), 2, ring=True)
    spec, totals = run(runner, prompts())
    assert spec == plain
    assert totals.k_steps[0] > 0 and totals.k_steps[1] > 0 and totals.k_steps[3] > 0


def test_the_ring_stages_every_narrower_step_in_a_contiguous_buffer():
    """GPU_NOTES 3: a device-to-host copy into a strided view of pinned memory is staged through
    pageable memory and blocks. Every (rows, k) a step can have reads through a contiguous buffer, and
    reads back exactly what the step wrote, while an older read of the same ring is still pending."""
    from specgen.pipelines.host_reader import HostReader

    B, K = 4, 3
    reader = HostReader(torch.device("cpu"), (B, K + 4), 2, ring=True)
    pending = None
    for rows in range(1, B + 1):
        for k in range(K + 1):
            out = torch.arange(rows * (k + 4)).view(rows, k + 4) * 10 + k
            read = reader.start(out)
            assert reader.staging(reader.turn, rows, k + 4).is_contiguous()
            if pending is not None:
                assert pending[0]() == pending[1].tolist()    # the other buffer of the ring is intact
            pending = (read, out)
    assert pending[0]() == pending[1].tolist()


def test_every_switch_with_an_oracle_draft(checkpoints):
    """The oracle is right most of the time, so blocks of every length meet every kind of switch."""
    ids = prompts()
    plain = plain_outputs(checkpoints)
    oracle = oracle_for(ids, plain, 3)
    spec, totals = run(scripted_runner(checkpoints, "eagle3", SCHEDULE, draft=oracle), ids)
    assert spec == plain
    assert totals.spec.acceptance_histogram[0] > 0 and totals.spec.acceptance_histogram[3] > 0


@pytest.mark.parametrize("method", ["eagle3", "mtp", "dflash"])
def test_the_draft_catches_up_on_the_positions_plain_steps_skipped(checkpoints, method):
    """One request: drafting all along, and with runs of plain steps, leave the same draft cache."""
    prompt = prompts(lengths=(9,))
    runs = {}
    for name, schedule in (("always", [2]), ("switching", [0, 0, 0, 0, 0, 0, 0, 2, 0, 1, 0, 0, 0, 0, 2])):
        runner = scripted_runner(checkpoints, method, schedule, batch=1)
        out, _ = run(runner, prompt, max_tokens=40)
        runs[name] = (out, runner.state.draft_len[0].item(), runner.caches.draft.tensors())
    assert runs["always"][0] == runs["switching"][0]
    covered = min(runs["always"][1], runs["switching"][1])
    assert covered > 30
    for a, b in zip(runs["always"][2], runs["switching"][2]):
        torch.testing.assert_close(a[0, :, :covered], b[0, :, :covered], atol=1e-5, rtol=1e-4)


class RecordingPolicy(ScriptedPolicy):
    """A scripted k that records the steps the runner times as their variant's cost."""

    def __init__(self, schedule: list[int]) -> None:
        super().__init__(schedule)
        self.timed: list[int] = []

    def observe_step(self, k: int, width: int, seconds: float) -> None:
        self.timed.append(k)


def test_a_draft_step_after_plain_steps_is_a_catch_up_not_the_variants_cost(checkpoints):
    """However short the plain run before it (one step here), the first draft step absorbs the
    positions it skipped: it is not timed as k's cost; the next step of k is."""
    runner = scripted_runner(checkpoints, "eagle3", [0, 1, 1], batch=1)
    runner.policy = policy = RecordingPolicy([0, 1, 1])
    _, totals = run(runner, prompts(lengths=(9,)), max_tokens=40)
    assert totals.k_steps[0] > 3 and totals.k_steps[1] > 6
    # per cycle: the plain step and the second k = 1 step (the first k = 1 step catches up)
    assert policy.timed.count(1) <= totals.k_steps[1] // 2 + 1
    assert policy.timed.count(0) >= totals.k_steps[0] - 1 and policy.timed.count(1) >= totals.k_steps[1] // 2 - 1


def test_plain_steps_of_a_drafting_runner_read_the_keys_a_plain_job_reads(checkpoints):
    """A step's key bound follows its own k: auto's plain steps attend over no more keys than a job
    without a draft, and a step of k over the bound a fixed K = k reads."""
    auto = scripted_runner(checkpoints, "eagle3", [0, 4])
    plain_recipe = recipe(checkpoints, "none")
    plain = build_runner(plain_recipe, resolve(plain_recipe), 7)[0]
    fixed = scripted_runner(checkpoints, "eagle3", [2])
    for longest in (0, 5, 50, 61, 100):
        assert auto.kv_bucket(longest, 0) == plain.kv_bucket(longest)
        assert auto.kv_bucket(longest, 2) == fixed.kv_bucket(longest)
        assert auto.kv_bucket(longest, 4) == auto.kv_bucket(longest) >= auto.kv_bucket(longest, 0)
    assert auto.kv_bucket(60, 4) > auto.kv_bucket(60, 0)     # where it matters: the bound crosses a granule


# ---------------------------------------------------------------------------- auto, end to end


class PinnedCosts(AdaptivePolicy):
    """Step costs set by the test, not measured: decisions independent of the machine."""

    def observe_step(self, k, width, seconds) -> None:
        pass


def auto_runner(checkpoints, draft=None, **sampling) -> Runner:
    r = recipe(checkpoints, "eagle3", k="auto", **sampling)
    base, _, _ = build_runner(r, resolve(r), r.sampling.seed)
    step = base.unified if draft is None else UnifiedStep(base.unified.target, draft)
    policy = PinnedCosts(step.k, [0.3] * step.k)
    runner = Runner(step, batch_size=base.batch_size, max_seq_len=base.max_seq_len, rules=base.rules,
                    sampling=base.sampling, seed=base.seed, device=base.device, dtype=torch.float32,
                    policy=policy)
    runner.warm_up()
    for k in range(step.k + 1):
        policy.set_cost(k, runner.batch_size, 0.040 + 0.003 * k)
    return runner


def test_auto_is_lossless_and_plain_for_a_draft_that_never_agrees(checkpoints):
    plain = plain_outputs(checkpoints)
    spec, totals = run(auto_runner(checkpoints), prompts())
    assert spec == plain
    assert totals.k_steps[0] > 0.7 * totals.steps       # random draft: mostly plain steps


def test_prompts_that_come_once_drafting_is_ruled_out_are_not_read_by_the_draft(checkpoints):
    """A draft that never agrees, at costs where no k could win: once a probe rules drafting out,
    later prompts skip the draft's pass over them (its share of every prefill), except one slot
    kept warm for a recheck; their drafts count as plain steps' blocks; the output stays plain's."""
    from specgen.pipelines.policy import AdaptivePolicy
    from specgen.pipelines.requests import Request

    ids = prompts() * 2
    # requests of other lengths: slots free one at a time, beside live ones
    requests = lambda: [Request(f"p{i}", p, 6 + 5 * (i % 3), 1000 + i) for i, p in enumerate(ids)]  # noqa: E731

    def outputs(runner):
        done = {}
        runner.run(requests(), lambda c: done.__setitem__(c.id, c.token_ids))
        return done

    r = recipe(checkpoints, "none", batch=2)
    plain = outputs(build_runner(r, resolve(r), r.sampling.seed)[0])
    r = recipe(checkpoints, "eagle3", k="auto", batch=2)
    base, _, _ = build_runner(r, resolve(r), r.sampling.seed)
    policy = PinnedCosts(base.unified.k, [0.3] * base.unified.k)
    runner = Runner(base.unified, batch_size=2, max_seq_len=base.max_seq_len, rules=base.rules,
                    sampling=base.sampling, seed=base.seed, device=base.device, dtype=torch.float32,
                    policy=policy)
    runner.warm_up()
    for k in range(base.unified.k + 1):        # a draft step costs three times a plain one: none can win
        policy.set_cost(k, 2, 0.040 * (1 + 2 * (k > 0)))
    reads = []
    propose = runner.unified.draft.propose
    runner.unified.draft.propose = lambda *a, **kw: reads.append(a[5].rows is not None) or propose(*a, **kw)
    asked = []
    keeps = AdaptivePolicy.keeps_draft_state
    policy.keeps_draft_state = lambda warm: asked.append((warm, keeps(policy, warm))) or asked[-1][1]
    assert outputs(runner) == plain
    totals = runner.totals
    assert policy.ruled_out
    # the first admission is read; once ruled out, a prompt is read only where no live slot is warm
    assert asked[0] == (0, True)
    assert any(not kept for _, kept in asked)
    assert all(kept == (warm == 0) for warm, kept in asked[asked.index(next(a for a in asked if not a[1])):])
    assert totals.unabsorbed_prompts == sum(not kept for _, kept in asked)
    assert sum(reads) == len(ids) - totals.unabsorbed_prompts          # the prefill's draft passes
    assert runner.cold == set()                                        # released with their slots


def test_a_ruled_out_policy_keeps_one_warm_slot_while_a_compiled_k_may_be_rechecked():
    policy = policy_with({0: 0.040, 1: 0.200, 2: 0.300, 3: 0.400}, prior=0.2)
    assert policy.keeps_draft_state(3)                     # nothing ruled out yet
    drive(policy, lambda k: 0, 3 * FIRST_PROBE_INTERVAL)
    assert policy.ruled_out
    assert not policy.keeps_draft_state(1) and policy.keeps_draft_state(0)
    drive(policy, lambda k: 0, 2 * FIRST_PROBE_INTERVAL, available=frozenset())   # nothing compiled to recheck
    assert not policy.keeps_draft_state(0)
    cold = [SlotView(b, 10_000, drafts=False) for b in range(WIDTH)]
    assert policy.rates(cold, WIDTH)[3] < policy.rates(cold, WIDTH)[0]    # a cold slot: one token a step
    policy.set_cost(1, WIDTH, 0.041)                       # drafting pays again: a choice of k > 0
    policy.settled = 1
    assert policy.choose(SLOTS, {1, 2, 3}, WIDTH) > 0 and not policy.ruled_out and policy.keeps_draft_state(3)


def test_auto_drafts_the_most_for_a_draft_that_is_always_right(checkpoints):
    ids = prompts()
    plain = plain_outputs(checkpoints)
    right = oracle_for(ids, plain, 4, wrong=never_wrong)
    spec, totals = run(auto_runner(checkpoints, draft=right), ids)
    assert spec == plain
    assert totals.spec.accepted_per_position == totals.spec.drafted_per_position     # really always right
    # 24 tokens a request: a request's last steps draft fewer (fewer tokens left to emit) and the
    # first ones learn from a pessimistic prior, so "the most" is the most frequent k and a high mean
    assert totals.k_steps[4] == max(totals.k_steps)
    assert sum(k * n for k, n in enumerate(totals.k_steps)) >= 3 * totals.steps


def test_auto_recipe_runs_and_reports_its_choices(tmp_path):
    """A recipe with `num_speculative_tokens: auto` through `run_job` (real tokenizer, text prompts)."""
    import json

    from specgen.job import run_job

    config = tiny_llama_config(vocab_size=300)
    target = write_mtp_target(tmp_path / "target", config)
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", tiny_eagle3_config(config), config)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i} " * (i + 1)}) + "\n"
                                    for i in range(5)))
    r = recipe({"target": target, "eagle3": draft}, "eagle3", k="auto")
    summary = run_job(r, prompts=str(prompts_file), output=str(tmp_path / "out.jsonl"))
    assert summary.stats["errors"] == 0
    speculation = summary.stats["speculation"]
    assert speculation["policy"] == "auto" and sum(speculation["k_steps"]) == summary.stats["steps"] > 0
    assert len(speculation["acceptance_per_position"]) == r.draft.k_max == 4
    # every request's steps are counted by k, plain ones included
    spec = summary.stats["spec"]
    assert len(spec["k_histogram"]) == 5 and sum(spec["k_histogram"]) >= summary.stats["steps"]


def compiled_runner(checkpoints, policy) -> Runner:
    r = recipe(checkpoints, "eagle3", k=3, batch=2)
    base, _, _ = build_runner(r, resolve(r), r.sampling.seed)
    return Runner(base.unified, batch_size=base.batch_size, max_seq_len=base.max_seq_len, rules=base.rules,
                  sampling=base.sampling, seed=base.seed, device=base.device, dtype=torch.float32,
                  policy=policy, compile=True)


def test_a_job_compiles_only_the_variants_it_can_repay(checkpoints):
    """Each variant (the draft of k and the verify of k + 1 rows, one graph) is compiled once, when
    first needed: a fixed K never builds the plain step; `auto` builds the plain step, and the
    variant the card says pays only where the job's tokens repay its compile time."""
    fixed = compiled_runner(checkpoints, FixedPolicy(3))
    fixed.warm_up()
    functions = fixed.functions
    assert functions.compiled_ks == {3} and set(functions.compile_seconds) == {("step", 3)}
    assert not any(functions.verify_ready(t) for t in (1, 2, 3))

    def warmed_auto(horizon: int) -> Runner:
        runner = compiled_runner(checkpoints, AdaptivePolicy(3, [0.95] * 3, horizon_tokens=horizon))
        runner.warm_up()
        return runner

    short = warmed_auto(10).functions
    assert short.verify_ready(1) and short.compiled_ks == set()
    assert not any(short.verify_ready(t) for t in (2, 3, 4))
    # one variant, the one its estimates say pays at this acceptance: k = 3 on an idle machine (the
    # fixed runner's graph, same weights and shapes, which the graph cache serves); the estimates
    # come from eager timings, so which k is not asserted (a loaded machine once made it k = 1)
    long = warmed_auto(10**9)
    assert long.functions.verify_ready(1) and len(long.functions.compiled_ks) == 1


def test_a_plain_step_loaded_from_the_graph_cache_does_not_make_variants_look_cheap(checkpoints, monkeypatch):
    """profile.cold_compile_seconds: a re-run that loads its plain step from Inductor's graph cache
    knows it did (`StepFunctions.from_graph_cache`) and estimates the variants it has not compiled
    from what lowering them anew takes, not from that load (3x too little: a short job would have
    compiled a variant it cannot repay)."""
    from torch._inductor.utils import fresh_cache

    from specgen.pipelines import compile_clock, profile

    monkeypatch.setattr(profile, "MIN_COMPILE_SECONDS", 0.0)
    # the threads a runner takes depend on the machine's load, and the kernels (so the cache key) on them
    monkeypatch.setattr("specgen.job.build.choose_threads", lambda requested: (1, "pinned by the test"))

    def warmed() -> Runner:
        torch._dynamo.reset()
        monkeypatch.setattr(compile_clock, "_slowest_lowering", 0.0)     # each run as in a process of its own
        runner = compiled_runner(checkpoints, AdaptivePolicy(3, [0.95] * 3, horizon_tokens=10))
        runner.warm_up()
        return runner

    with fresh_cache():
        first, again = warmed(), warmed()
    assert first.functions.from_graph_cache == set()
    assert again.functions.from_graph_cache == {("verify", 1)}
    for runner, factor in ((first, 1.0), (again, profile.COLD_OVER_CACHED_COMPILE)):
        functions, estimates = runner.functions, runner.policy.compile_estimate
        assert functions.compiled_ks == set() and set(estimates) == {1, 2, 3}
        plain = functions.compile_seconds[("verify", 1)]
        # the verify as the plain step's compile (cold), the draft adding at most as much again
        assert all(factor * plain <= estimates[k] <= 2 * factor * plain for k in (1, 2, 3))


def test_a_fast_plain_compile_does_not_make_variants_look_cheap_after_another_runner(monkeypatch):
    """profile.cold_compile_seconds: in a process that built another runner's graphs before (bench),
    a plain step may compile fast on kernels built then, while a variant of other shapes builds its
    own; its estimate is at least the slowest lowering the process has seen."""
    from types import SimpleNamespace

    from specgen.pipelines import compile_clock, profile

    functions = SimpleNamespace(compile_seconds={("verify", 1): 5.0}, from_graph_cache=set())
    monkeypatch.setattr(compile_clock, "_slowest_lowering", 0.0)
    assert profile.cold_compile_seconds(functions, ("verify", 1)) == 5.0
    monkeypatch.setattr(compile_clock, "_slowest_lowering", 80.0)
    assert profile.cold_compile_seconds(functions, ("verify", 1)) == 80.0
    assert profile.cold_compile_seconds(functions, ("step", 2)) == 0.0        # nothing compiled: no figure
