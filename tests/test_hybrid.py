"""Hybrid drafts (`eagle3+suffix`, `mtp+suffix`, `dflash+suffix`): a draft model and host proposals in one step.

Held to what every draft is held to: greedy and seeded sampled output equal to plain decoding's, for
each model draft beside suffix proposals (Llama GQA, DeepSeek-V3 MLA + MoE, Kimi K2.5), eager and
compiled (the merge of the host's rows runs inside the compiled step), with both kinds of blocks
really verified; a job whose answers repeat reaches a long acceptance; and the policy's per-slot
choice, its host-only steps and what each part learns, on fixed numbers.
"""

from __future__ import annotations

import pytest
from test_deepseek_pairings import recipe as pairing_recipe
from test_deepseek_pairings import write_pairings
from test_speculative import models, prompts, run, runner_for  # noqa: F401 (models: a fixture)
from test_suffix import plain_recipe, proposal, repeated_prompts

from specgen.parallel.decisions import SharedDecisions
from specgen.pipelines.host_policy import REMEASURE_FIRST, HostDraftPolicy
from specgen.pipelines.hybrid_policy import HybridPolicy
from specgen.pipelines.policy import AdaptivePolicy, FixedPolicy
from specgen.pipelines.requests import Request
from specgen.recipe import RecipeError, recipe_from_dict
from specgen.registry import UnsupportedError, check_pairing


def hybrid_recipe(target, draft, k=3, batch=3, compile=False, method="eagle3+suffix", **sampling):
    return recipe_from_dict({
        "target": {"model": str(target), "dtype": "float32"},
        "draft": {"method": method, "model": str(draft), "num_speculative_tokens": k},
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": batch, "max_seq_len": 96, "compile": compile},
        "chat_template": False,
    })


def fixed_costs(monkeypatch, plain=0.010, per_row=0.0004):
    """Both policies' step costs from fixed figures (a model step: its rows and a draft pass; a host
    step: its rows), not this machine's timings."""
    monkeypatch.setattr(HostDraftPolicy, "cost", lambda self, k, width: plain + per_row * k)
    monkeypatch.setattr(AdaptivePolicy, "cost", lambda self, k, width: plain + (2 * per_row) * k + 0.002 * (k > 0))


def both_kinds_verified(runner) -> None:
    blocks = runner.policy.blocks
    assert blocks["host"] > 0 and blocks["model"] > 0, runner.policy.summary()


@pytest.mark.parametrize(("batch", "k"), [(1, 3), (3, 3), (3, "auto")])
def test_greedy_hybrid_equals_greedy_plain(models, batch, k, monkeypatch):
    target, draft = models
    fixed_costs(monkeypatch)
    ids = repeated_prompts()
    plain, _ = run(runner_for(plain_recipe(target, batch=batch)), ids)
    runner = runner_for(hybrid_recipe(target, draft, k=k, batch=batch))
    assert runner.hybrid and runner.unified.host_drafts and isinstance(runner.policy, HybridPolicy)
    got, totals = run(runner, ids)
    assert got == plain
    both_kinds_verified(runner)
    histogram = totals.spec.acceptance_histogram
    assert histogram[0] > 0 and histogram[-1] > 0, histogram
    if k == "auto" or batch == 1:   # some steps were the host's alone (the draft skipped, then caught up)
        assert runner.policy.steps["host"] > 0, runner.policy.summary()


def test_seeded_sampled_hybrid_equals_seeded_plain(models):
    target, draft = models
    ids = repeated_prompts()
    sampling = {"temperature": 0.5, "top_p": 0.9}
    plain, _ = run(runner_for(plain_recipe(target, **sampling)), ids)
    assert plain != run(runner_for(plain_recipe(target)), ids)[0]
    runner = runner_for(hybrid_recipe(target, draft, **sampling))
    got, totals = run(runner, ids)
    assert got == plain
    both_kinds_verified(runner)
    assert totals.spec.num_accepted_tokens > 0


def test_a_hybrid_job_whose_answers_repeat_accepts_long_blocks(models):
    """Batch 1: the second answer is drafted from the first by the suffix part, whatever the model's
    (random) draft proposes."""
    target, draft = models
    prompt = prompts(lengths=(9,))[0]
    runner = runner_for(hybrid_recipe(target, draft, k=4, batch=1))
    done = {}
    runner.run([Request(f"r{i}", prompt, 40, request_key=i) for i in range(2)],
               lambda c: done.__setitem__(c.id, (c.token_ids, c.spec)))
    (first, _), (second, spec) = done["r0"], done["r1"]
    assert second == first
    assert spec.mean_acceptance_length > 3.5, spec.acceptance_histogram


def test_compiled_hybrid_steps_keep_the_plain_output(models):
    """The host's rows are merged into the model's block inside the compiled step (frozen, the CPU's
    GEMM template): the output stays the plain step's."""
    target, draft = models
    ids = repeated_prompts()[:6]
    plain, _ = run(runner_for(plain_recipe(target, batch=2)), ids)
    runner = runner_for(hybrid_recipe(target, draft, k=2, batch=2, compile=True))
    got, totals = run(runner, ids)
    assert got == plain
    assert runner.compiled and runner.functions.compiled_ks == {2}
    both_kinds_verified(runner)
    assert totals.spec.acceptance_histogram[2] > 0, totals.spec.acceptance_histogram


@pytest.fixture(scope="module")
def pairings(tmp_path_factory):
    return write_pairings(tmp_path_factory.mktemp("hybrid-pairs"), 96)


@pytest.mark.parametrize(("name", "sampled"), [("deepseek-mtp", False), ("deepseek-mtp", True),
                                               ("kimi-dflash", False), ("deepseek-eagle3", False)])
def test_each_model_draft_beside_suffix_keeps_the_plain_output(pairings, name, sampled):
    target, method, draft, k = pairings[name]
    sampling = {"temperature": 0.1} if sampled else {}     # cold enough to repeat itself
    ids = repeated_prompts()
    plain, _ = run(runner_for(pairing_recipe(target, **sampling)), ids, max_tokens=20)
    runner = runner_for(pairing_recipe(target, f"{method}+suffix", draft, k, **sampling))
    got, totals = run(runner, ids, max_tokens=20)
    assert got == plain
    both_kinds_verified(runner)
    assert totals.spec.num_accepted_tokens > 0


def test_hybrid_recipes_name_both_parts():
    recipe = recipe_from_dict({"target": {"model": "x"},
                               "draft": {"method": "mtp+suffix", "num_speculative_tokens": "auto"}})
    assert (recipe.draft.model_method, recipe.draft.host_method) == ("mtp", "suffix")
    assert recipe.draft.has_model and recipe.draft.k_max == 4
    with pytest.raises(RecipeError, match="draft.model"):      # EAGLE-3's checkpoint is still needed
        recipe_from_dict({"target": {"model": "x"}, "draft": {"method": "eagle3+suffix"}})
    with pytest.raises(RecipeError, match="draft.stochastic"):
        recipe_from_dict({"target": {"model": "x"},
                          "draft": {"method": "eagle3+suffix", "model": "d", "stochastic": True}})
    check_pairing("KimiK25ForConditionalGeneration", "dflash+suffix")
    with pytest.raises(UnsupportedError, match="eagle3\\+suffix"):     # Kimi ships no MTP layer
        check_pairing("KimiK25ForConditionalGeneration", "mtp+suffix")


# ------------------------------------------------------------------------------------------ the policy


def hybrid_policy(adaptive: bool, acceptance: float = 0.5, calibration=(10.0, 7.0)) -> HybridPolicy:
    k = 3
    estimator = AdaptivePolicy(k, [acceptance] * k)
    model = estimator if adaptive else FixedPolicy(k)
    host = HostDraftPolicy(k)
    host.predicted, host.accepted = calibration
    return HybridPolicy(model, host, None if adaptive else estimator)


def test_each_slot_takes_the_block_expected_to_accept_more():
    policy = hybrid_policy(adaptive=False)
    # the model expects 0.5 + 0.25 + 0.125 = 0.875 drafts; the host's c = 0.7 times its summed probs
    proposals = {0: proposal(0.9, 0.8, 0.7), 1: proposal(0.4, 0.3), 2: proposal()}
    plan = policy.decide(3, proposals, 3, set(), compiled=False)
    assert (plan.k, plan.host_only, plan.use) == (3, False, {0})
    # slot 0 took the host's block: the host calibrates on it, the model's acceptance hears nothing
    before = policy.estimator.job_rates()
    policy.observe_block(0, 3, 3)
    assert policy.estimator.job_rates() == before and policy.host.verified == pytest.approx([2.4, 3.0])
    policy.observe_block(1, 3, 0)
    assert policy.estimator.job_rates()[0] < before[0]
    assert policy.blocks == {"host": 1, "model": 1}


def test_auto_skips_the_draft_where_the_host_alone_pays_more(monkeypatch):
    fixed_costs(monkeypatch)
    policy = hybrid_policy(adaptive=True, acceptance=0.3)
    strong = {0: proposal(0.95, 0.9, 0.85), 1: proposal(0.9, 0.9, 0.9)}
    plan = policy.decide(2, strong, 2, {3}, compiled=False)
    assert plan.host_only and plan.k == 3 and plan.use == {0, 1}
    # a host step's time is the host's cost; the model's costs hear nothing of it
    seen = []
    monkeypatch.setattr(AdaptivePolicy, "observe_step", lambda self, k, w, s: seen.append(k))
    policy.observe_step(3, 2, 0.02)
    assert seen == [] and list(policy.host.costs) == [(2, 3)]
    # where no proposal is worth its rows, the model's step runs as its policy chose (a probe here)
    weak = {0: proposal(0.2), 1: proposal()}
    policy.model.reason = "probe"
    plan = policy.decide(2, weak, 2, {3}, compiled=False)
    assert (plan.k, plan.host_only, plan.use) == (2, False, set())
    assert policy.steps == {"plain": 0, "model": 1, "mixed": 0, "host": 1}


def test_a_model_step_chosen_at_par_with_plain_decoding_runs_plain(monkeypatch):
    """Beside the host, the model's best-estimate step must beat the plain step by the host's margin
    (host_policy.margin); its probes run regardless: they are how it measures acceptance."""
    fixed_costs(monkeypatch)          # k = 2: 13.6 ms against 10 for a plain step
    weak = {0: proposal(0.2), 1: proposal()}
    # acceptance 0.3: 2 x 1.39 tokens in 13.6 ms, 2% above plain decoding's rate, short of 6.6%
    policy = hybrid_policy(adaptive=True, acceptance=0.3)
    plan = policy.decide(2, weak, 2, {3}, compiled=False)
    assert (plan.k, plan.use) == (0, set()) and policy.held_back == 1
    assert policy.summary()["hybrid"]["held_back"] == 1
    policy.model.reason = "probe"
    assert policy.decide(2, weak, 2, {3}, compiled=False).k == 2
    # acceptance 0.6: 2 x 1.96 tokens, 44% above: the step runs
    policy = hybrid_policy(adaptive=True, acceptance=0.6)
    plan = policy.decide(2, weak, 2, {3}, compiled=False)
    assert (plan.k, plan.host_only, plan.use) == (2, False, set()) and policy.held_back == 0


def test_where_the_model_runs_plain_a_compiled_model_step_carries_the_host_blocks(monkeypatch):
    fixed_costs(monkeypatch)
    policy = hybrid_policy(adaptive=True, acceptance=0.05)
    strong = {0: proposal(0.95, 0.9, 0.85), 1: proposal()}
    # no host-only variant compiled (nor worth compiling: no estimate), the model's K = 3 is
    plan = policy.decide(0, strong, 2, set(), compiled=True, model_ready={3})
    assert (plan.k, plan.host_only, plan.use) == (3, False, {0})
    # without a compiled model step, or with proposals too weak for its cost: plain
    assert policy.decide(0, strong, 2, set(), compiled=True).k == 0
    assert policy.decide(0, {0: proposal(0.3), 1: proposal()}, 2, set(), compiled=True, model_ready={3}).k == 0


def test_a_hybrid_measures_again_the_host_step_its_measured_cost_forbids(monkeypatch):
    """Three slow host-only steps (a slow spell) forbid the host's variant; as for suffix alone it runs
    again after REMEASURE_FIRST such steps, priced at its warm-up figure, and that time counts afresh."""
    monkeypatch.setattr(AdaptivePolicy, "cost", lambda self, k, width: 0.010 + 0.0028 * k)
    policy = hybrid_policy(adaptive=True, acceptance=0.3)
    host = policy.host
    host.profiled[(2, 0)], host.profiled[(2, 3)] = 0.010, 0.0112
    for _ in range(3):
        host.observe_step(3, 2, 0.100)
    strong = {0: proposal(0.95, 0.9, 0.85), 1: proposal(0.9, 0.9, 0.9)}
    plans = [policy.decide(0, strong, 2, {3}, compiled=False) for _ in range(REMEASURE_FIRST)]
    assert [p.host_only for p in plans] == [False] * (REMEASURE_FIRST - 1) + [True]
    policy.observe_step(3, 2, 0.0112)
    assert host.cost(3, 2) == pytest.approx(0.0112)
    assert policy.decide(0, strong, 2, {3}, compiled=False).host_only


class _FakeCopy:
    """A tensor-parallel copy's World as SharedDecisions sees it: the first rank's answer is this one's."""

    def from_tp_leader(self, value):
        return value


def test_under_tensor_parallel_each_policy_hears_each_block_once(monkeypatch):
    """job/run.py wraps an adaptive hybrid's model policy and the hybrid itself in SharedDecisions (one k
    per step for the copy's ranks); the model policy must still hear each block, admit and move once
    (twice, its acceptance decayed twice as fast and a moved slot lost its own figures)."""
    fixed_costs(monkeypatch)
    calls = []
    for cls in (AdaptivePolicy, HostDraftPolicy):
        for name in ("admit", "move"):
            def spy(self, *args, _original=getattr(cls, name), _name=name):
                calls.append((type(self).__name__, _name, args))
                return _original(self, *args)
            monkeypatch.setattr(cls, name, spy)
    hybrid = hybrid_policy(adaptive=True, acceptance=0.6)
    model = hybrid.model
    hybrid.model = SharedDecisions(hybrid.model, _FakeCopy())      # as job/run.py does
    policy = SharedDecisions(hybrid, _FakeCopy())
    policy.admit(0)
    assert sorted(calls) == [("AdaptivePolicy", "admit", (0,)), ("HostDraftPolicy", "admit", (0,))]
    plan = policy.decide(2, {0: proposal(0.2)}, 1, {3}, compiled=False)
    assert (plan.k, plan.host_only, plan.use) == (2, False, set())
    policy.observe_block(0, 2, 1)
    # one block of 2 drafts, 1 accepted: positions 1 and 2 tried once, position 1 accepted once
    assert (model._job.attempts, model._job.accepts) == ([1.0, 1.0, 0.0], [1.0, 0.0, 0.0])
    assert (model._slots[0].attempts, model._produced) == ([1.0, 1.0, 0.0], 2)
    calls.clear()
    policy.move(0, 1)
    assert sorted(calls) == [("AdaptivePolicy", "move", (0, 1)), ("HostDraftPolicy", "move", (0, 1))]
    assert model._slots[1].attempts == [1.0, 1.0, 0.0] and 0 not in model._slots    # the slot's own figures moved
