"""Suffix drafting: the index (insert, match, scoring, boundaries, the cap) and the pipeline with it.

The pipeline tests hold suffix drafts to what every draft is held to: greedy and seeded sampled output
equal to plain decoding's, with acceptances that really happened, beside a Llama target (GQA cache)
and a DeepSeek-V3 one (MLA cache, MoE); and a job whose answers repeat reaches a long acceptance.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_deepseek_pairings import recipe as deepseek_recipe
from test_deepseek_pairings import write_pairings
from test_speculative import models, prompts, run, runner_for  # noqa: F401 (models: a fixture)
from typer.testing import CliRunner

from specgen.cli import app
from specgen.data import ResultsFileError, read_answer_ids, stats_path
from specgen.drafts.suffix import NO_PROPOSAL, Proposal, SuffixIndex, SuffixProposer
from specgen.job import InputError
from specgen.pipelines.host_policy import REMEASURE_FIRST, HostDraftPolicy
from specgen.pipelines.requests import Request
from specgen.pipelines.runner import Runner
from specgen.recipe import RecipeError, recipe_from_dict

# ------------------------------------------------------------------------------------------ the index


def test_the_longest_match_decides_and_frequencies_score_the_path():
    index = SuffixIndex()
    index.append([1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3])
    # "1 2 3" occurred twice before the end (which is the pattern itself, not an occurrence), both
    # followed by 4; after "4" once 5 and once 6 (a tie: the smaller id), then 1; the match is 3
    # tokens long, so at most 3 tokens (max_spec_factor 1)
    proposal = index.propose(index.tokens, 5, live=True)
    assert proposal.tokens == (4, 5, 1)
    assert proposal.probs == (1.0, 0.5, 0.5)
    assert proposal.score == pytest.approx(2.0)
    # a longer match beats a more frequent shorter one: "9 1 2 3" occurred once, followed by 7
    index.append([9, 1, 2, 3, 7, 8, 9, 1, 2, 3])
    assert index.propose(index.tokens, 2, live=True).tokens == (7, 8)


def test_the_path_stops_below_the_minimum_probability_and_at_k():
    index = SuffixIndex(min_token_prob=0.3)
    # after "5 6": 7 four times, then 8 / 9 / 10 / 11 once each (each 0.25 < 0.3 of the path)
    for tail in (8, 9, 10, 11):
        index.append([5, 6, 7, tail])
        index.close()
    proposal = index.propose([5, 6], 4)
    assert proposal.tokens == (7,) and proposal.probs == (1.0,)
    assert index.propose([5, 6], 0) is NO_PROPOSAL
    assert index.propose([6], 4) is NO_PROPOSAL          # one token is no pattern
    assert index.propose([1, 2], 4) is NO_PROPOSAL       # never seen


def test_no_continuation_crosses_the_end_of_a_sequence():
    index = SuffixIndex()
    index.append([3, 4, 5])
    index.close()
    index.append([6, 7])
    assert index.propose([3, 4, 5, 6], 3) is NO_PROPOSAL      # "5 6" spans the boundary: never a pair
    assert index.propose([2, 3, 4], 3).tokens == (5,)          # and "3 4 5" ends at it
    with pytest.raises(ValueError):
        index.append([-1])


def test_the_cap_keeps_the_newest_outputs_whole():
    index = SuffixIndex(max_tokens=100)
    for n in range(30):
        index.append([1000 + n, 1, 2, 3, 4000 + n])
        index.close()
    assert len(index) <= 100
    assert index.tokens[-1] == -1 and index.tokens[0] != -1 and index.tokens[index.tokens.index(-1) - 1] >= 4000
    # the oldest outputs are gone, the newest still propose
    assert len(index.propose([1000, 1, 2, 3], 1)) == 0      # "1 2 3": then any of 22 ids, none likely
    assert index.propose([1029, 1, 2, 3], 1).tokens == (4029,)


def test_what_the_index_costs_per_token():
    """The figure the module docstring and the README quote: bytes held per token of text."""
    gen = torch.Generator().manual_seed(0)
    # a text-like stream: Zipf-distributed ids over a 49k vocabulary (SmolLM2's)
    ranks = torch.arange(1, 49153, dtype=torch.float64)
    tokens = torch.multinomial(1 / ranks, 200_000, replacement=True, generator=gen).tolist()
    index = SuffixIndex()
    index.append(tokens)
    per_token = index.nbytes() / len(index)
    assert 10 < per_token < 100, per_token      # 77 on this stream (Zipf: few repeated pairs)


def test_the_proposer_takes_the_better_of_the_request_and_the_job():
    proposer = SuffixProposer(2)
    proposer.admit(0, [5, 6, 7, 5, 6])
    # before its first output token reaches the host nothing is proposed: a proposal from the
    # prompt's end ("5 6" -> 7) would stand one position before the drafts' place
    assert proposer.propose(0, 3) is NO_PROPOSAL
    proposer.extend(0, [10, 11, 12, 13, 14])
    proposer.finish(0)                     # its output joins the job-wide index
    proposer.admit(1, [8, 9])
    proposer.extend(1, [10, 11])
    # its own text has no "10 11" before; the job's output continues it
    assert proposer.propose(1, 3).tokens == (12, 13)      # a 2-token match: at most 2 tokens
    proposer.extend(1, [12, 13, 10, 11])
    # now its own text has "12 13 10 11"? no: "10 11" once (followed by 12, probability 1) in its own,
    # and in the job's; both score the same, its own is kept
    assert proposer.propose(1, 2).tokens == (12, 13)
    proposer.reset()
    assert proposer.propose(1, 2) is NO_PROPOSAL and len(proposer.job) == 0


# --------------------------------------------------------------------------------------- the pipeline


def suffix_recipe(target, k=4, batch=4, compile=False, history=None, **sampling):
    return recipe_from_dict({
        "target": {"model": str(target), "dtype": "float32"},
        "draft": {"method": "suffix", "num_speculative_tokens": k, "suffix_history": history},
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": batch, "max_seq_len": 96, "compile": compile},
        "chat_template": False,
    })


def plain_recipe(target, batch=4, **sampling):
    return recipe_from_dict({
        "target": {"model": str(target), "dtype": "float32"}, "draft": {"method": "none"},
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": batch, "max_seq_len": 96, "compile": False},
        "chat_template": False,
    })


def repeated_prompts():
    # each prompt twice: a job's second answer to a prompt repeats its first (greedy)
    return [p for p in prompts(lengths=(3, 11, 6, 17)) for _ in range(2)]


@pytest.mark.parametrize(("batch", "k"), [(1, 4), (3, 4), (3, "auto")])
def test_greedy_suffix_equals_greedy_plain(models, batch, k, monkeypatch):
    target, _ = models
    # auto's choices from fixed step costs (a drafted step 1% dearer), not this machine's timings
    monkeypatch.setattr(HostDraftPolicy, "cost", lambda self, k, width: 0.010 + 0.0001 * k / self.k_max)
    ids = repeated_prompts()
    plain, _ = run(runner_for(plain_recipe(target, batch=batch)), ids)
    runner = runner_for(suffix_recipe(target, k=k, batch=batch))
    assert runner.proposer is not None and runner.unified.draft is None and runner.unified.k == 4
    assert isinstance(runner.policy, HostDraftPolicy) == (k == "auto")
    got, totals = run(runner, ids)
    assert got == plain
    histogram = totals.spec.acceptance_histogram
    assert totals.spec.num_drafts > 0 and histogram[0] > 0 and histogram[4] > 0, histogram


class AlignedProposer(SuffixProposer):
    """Checks, at every proposal, that the host's last token for the slot is the device's
    `pending[slot, 0]`, the token the drafts continue (refills, narrowing, first steps)."""

    def __init__(self, slots: int) -> None:
        super().__init__(slots)
        self.runner, self.checked = None, 0

    def propose(self, slot, k):
        if self.outputs[slot]:
            assert int(self.runner.state.pending[slot, 0]) == self.requests[slot].tokens[-1]
            self.checked += 1
        return super().propose(slot, k)


def test_proposals_continue_the_token_the_device_holds(models):
    target, _ = models
    ids = repeated_prompts()
    plain, _ = run(runner_for(plain_recipe(target, batch=3)), ids)
    built = runner_for(suffix_recipe(target, batch=3))
    proposer = AlignedProposer(3)
    runner = Runner(built.unified, batch_size=3, max_seq_len=built.max_seq_len, rules=built.rules,
                    sampling=built.sampling, seed=built.seed, device=built.device, dtype=torch.float32,
                    overlap=True, proposer=proposer)
    proposer.runner = runner
    assert runner.lag == 0              # host drafts need the previous step's tokens: never lagged
    got, totals = run(runner, ids)
    assert got == plain and proposer.checked > 50 and totals.spec.num_accepted_tokens > 0
    assert runner.width < 3             # the run's tail was narrowed (slots moved) and stayed aligned


def test_seeded_sampled_suffix_equals_seeded_plain(models):
    target, _ = models
    ids = repeated_prompts()
    sampling = {"temperature": 0.5, "top_p": 0.9}
    plain, _ = run(runner_for(plain_recipe(target, **sampling)), ids)
    greedy, _ = run(runner_for(plain_recipe(target)), ids)
    assert plain != greedy
    got, totals = run(runner_for(suffix_recipe(target, **sampling)), ids)
    assert got == plain
    assert totals.spec.num_accepted_tokens > 0 and totals.spec.acceptance_histogram[0] > 0


def test_a_job_whose_answers_repeat_accepts_long_blocks(models):
    """Batch 1: the second answer to each prompt is drafted from the first (the job-wide index)."""
    target, _ = models
    prompt = prompts(lengths=(9,))[0]
    runner = runner_for(suffix_recipe(target, k=4, batch=1))
    counters = {}
    requests = [Request(f"r{i}", prompt, 40, request_key=i) for i in range(3)]
    runner.run(requests, lambda c: counters.__setitem__(c.id, (c.token_ids, c.spec)))
    (first, _), (second, spec) = counters["r0"], counters["r1"]
    assert second == first
    # all but the opening blocks (a match needs two tokens) accept every drafted token
    assert spec.mean_acceptance_length > 3.5, spec.acceptance_histogram
    # a new run forgets the job: its first answer has nothing to draft from but its own text
    again = {}
    runner.run(requests[:1], lambda c: again.__setitem__(c.id, c.spec))
    assert again["r0"].num_accepted_tokens == counters["r0"][1].num_accepted_tokens
    # one job run in parts (bench's legs of a round) carries its job-wide index from part to part
    job, parts = runner.proposer.new_job(), {}
    for request in requests[:2]:
        runner.run([request], lambda c: parts.__setitem__(c.id, c.spec), suffix_job=job)
    assert parts["r1"].num_accepted_tokens == counters["r1"][1].num_accepted_tokens
    assert parts["r1"].mean_acceptance_length > 3.5


def test_a_run_starts_from_earlier_answers_only_where_asked(models, tmp_path):
    """`draft.suffix_history`: an earlier run's results file seeds the job-wide index (its torn last
    line skipped), so the first answer of a new run already drafts from the old one; a line that is
    not a result is an error naming it."""
    target, _ = models
    request = Request("r0", prompts(lengths=(9,))[0], 40, request_key=0)
    earlier = {}
    runner_for(suffix_recipe(target, batch=1)).run([request], lambda c: earlier.__setitem__(c.id, c))
    results = tmp_path / "earlier.jsonl"
    results.write_text(json.dumps({"id": "r0", "token_ids": earlier["r0"].token_ids}) + "\n"
                       + json.dumps({"id": "bad", "token_ids": [], "finish_reason": "error"}) + "\n"
                       + '{"id": "torn", "token_')
    again = {}
    runner_for(suffix_recipe(target, batch=1, history=str(results))).run(
        [request], lambda c: again.__setitem__(c.id, c))
    assert again["r0"].token_ids == earlier["r0"].token_ids
    assert earlier["r0"].spec.mean_acceptance_length < 2.5 < 3.5 < again["r0"].spec.mean_acceptance_length
    results.write_text(json.dumps({"id": "r0", "token_ids": [1, 2]}) + "\nnot json\n")
    with pytest.raises(InputError, match="draft.suffix_history: earlier.jsonl line 2: not valid JSON"):
        runner_for(suffix_recipe(target, batch=1, history=str(results)))
    with pytest.raises(RecipeError, match="draft.suffix_history: applies to suffix drafting only"):
        recipe_from_dict({"target": {"model": "x"},
                          "draft": {"method": "mtp", "suffix_history": str(results)}})


def test_the_history_reader_names_the_line_of_an_id_outside_the_vocabulary(tmp_path):
    results = tmp_path / "old.jsonl"
    results.write_text(json.dumps({"id": "a", "token_ids": [5, 95]}) + "\n\n"
                       + json.dumps({"id": "b", "token_ids": [7, 96, 8]}) + "\n")
    assert read_answer_ids(results) == [[5, 95], [7, 96, 8]]          # no vocabulary given: no check
    assert read_answer_ids(results, vocab_size=97) == [[5, 95], [7, 96, 8]]
    with pytest.raises(ResultsFileError, match=r"^old\.jsonl line 3: token id 96 is outside the target's "
                                               r"vocabulary of 96 tokens \(ids 0\.\.95\)$"):
        read_answer_ids(results, vocab_size=96)


def test_a_history_id_outside_the_vocabulary_stops_the_run_before_any_model_loads(models, tmp_path, monkeypatch):
    """`specgen run` with a `draft.suffix_history` holding an id the target's embedding lacks: exit 2
    naming the file, the line and the vocabulary, before anything loads (not a failed lookup, or a
    device assert on CUDA, once the id is proposed)."""
    import specgen.job.build
    import specgen.job.resolved

    target, _ = models      # a vocabulary of 96 ids
    history = tmp_path / "old.jsonl"
    history.write_text(json.dumps({"id": "a", "token_ids": [5, 6, 7]}) + "\n"
                       + json.dumps({"id": "e", "token_ids": [], "finish_reason": "error"}) + "\n"
                       + json.dumps({"id": "b", "token_ids": [5, 6, 50000]}) + "\n")
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"id": "p", "prompt": "hello"}) + "\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(json.dumps({
        "target": {"model": str(target), "dtype": "float32"},
        "draft": {"method": "suffix", "num_speculative_tokens": 3, "suffix_history": str(history)},
        "sampling": {"max_tokens": 8, "ignore_eos": True, "seed": 7},
        "runtime": {"device": "cpu", "batch_size": 1, "max_seq_len": 96, "compile": False},
        "chat_template": False}))

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    for module in (specgen.job.resolved, specgen.job.build):      # the dry loads, the real ones
        for name in ("load_target", "load_draft", "load_tokenizer"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, no_loading)
    out = tmp_path / "out" / "results.jsonl"
    result = CliRunner().invoke(app, ["run", str(recipe), "--prompts", str(prompts_file), "--output", str(out)],
                                terminal_width=200)
    assert result.exit_code == 2, (result.output, result.exception)
    assert ("draft.suffix_history: old.jsonl line 3: token id 50000 is outside the target's vocabulary of 96 "
            "tokens (ids 0..95)") in " ".join(result.output.split()), result.output
    assert not out.exists() and not stats_path(out).exists()


def test_compiled_suffix_steps_keep_the_plain_output(models):
    """The host writes its drafts into `pending` before the compiled verify of K + 1 rows (frozen,
    the CPU's GEMM template), and plain steps run the compiled plain step: both as in a job."""
    target, _ = models
    ids = repeated_prompts()[:6]
    plain, _ = run(runner_for(plain_recipe(target, batch=2)), ids)
    runner = runner_for(suffix_recipe(target, k=3, batch=2, compile=True))
    got, totals = run(runner, ids)
    assert got == plain
    assert runner.compiled and runner.functions.compiled_ks == {3} and runner.functions.verify_ready(1)
    histogram = totals.spec.acceptance_histogram
    assert histogram[0] > 0 and histogram[3] > 0 and totals.k_steps[0] > 0, (histogram, totals.k_steps)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return write_pairings(tmp_path_factory.mktemp("suffix-ds"), 96)["deepseek-mtp"][0]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_suffix_beside_an_mla_target_keeps_the_plain_output(deepseek, sampled):
    sampling = {"temperature": 0.1} if sampled else {}
    ids = repeated_prompts()
    plain, _ = run(runner_for(deepseek_recipe(deepseek, **sampling)), ids, max_tokens=20)
    if sampled:        # cold enough to repeat itself, hot enough to sample
        assert plain != run(runner_for(deepseek_recipe(deepseek)), ids, max_tokens=20)[0]
    got, totals = run(runner_for(deepseek_recipe(deepseek, "suffix", None, 3, **sampling)), ids, max_tokens=20)
    assert got == plain
    assert totals.spec.num_accepted_tokens > 0, totals.spec.acceptance_histogram


def test_a_suffix_recipe_needs_no_model_and_trains_nothing():
    recipe = recipe_from_dict({"target": {"model": "x"}, "draft": {"method": "suffix"}})
    assert recipe.draft.enabled and not recipe.draft.has_model
    assert recipe.draft.num_speculative_tokens == 3
    with pytest.raises(RecipeError, match="recipe.draft.stochastic: applies to draft models only"):
        recipe_from_dict({"target": {"model": "x"}, "draft": {"method": "suffix", "stochastic": True}})


# ------------------------------------------------------------------------------ auto: HostDraftPolicy


def proposal(*probs):
    return Proposal(tuple(range(10, 10 + len(probs))), tuple(probs))


def policy_with_costs(plain, drafted, k=4, **settings):
    policy = HostDraftPolicy(k, **settings)
    policy.profiled[(1, 0)], policy.profiled[(1, k)] = plain, drafted
    return policy


def test_auto_verifies_only_proposals_worth_their_step():
    # a drafted step costs twice a plain one: worth it only where about one more token is expected
    policy = policy_with_costs(0.010, 0.020)
    c = policy.calibration()
    assert policy.choose_host({0: NO_PROPOSAL}, 1, {4}, True) == 0
    assert policy.choose_host({0: proposal(0.9)}, 1, {4}, True) == 0          # 1 + 0.63 < 2
    assert policy.choose_host({0: proposal(1.0, 1.0, 0.9)}, 1, {4}, True) == 4  # 1 + 2.03 > 2
    assert c == pytest.approx(0.7)
    # where the drafted step costs what a plain one does, any likely proposal is verified
    cheap = policy_with_costs(0.010, 0.0101)
    assert cheap.choose_host({0: proposal(0.3)}, 1, {4}, True) == 4
    # eager: each k costs its rows; the best k for these probabilities, not the longest
    eager = policy_with_costs(0.010, 0.014)         # 1 ms a row past the first
    assert eager.choose_host({0: proposal(1.0, 1.0, 0.1, 0.1)}, 1, {1, 2, 3, 4}, False) == 2
    # and where a row costs what a plain step does, drafting never pays below certainty
    assert policy_with_costs(0.010, 0.050).choose_host({0: proposal(0.9, 0.9)}, 1, {1, 2, 3, 4}, False) == 0


def test_one_slow_first_step_does_not_shut_a_variant_out():
    # a variant is measured only while chosen: its first step, 20x the profile (a one-off), must not
    # decide alone; three slow steps do
    policy = policy_with_costs(0.010, 0.012)
    likely = {0: proposal(1.0, 1.0)}
    assert policy.choose_host(likely, 1, {4}, True) == 4
    policy.observe_step(4, 1, 0.240)
    assert policy.cost(4, 1) == pytest.approx(0.012)
    assert policy.choose_host(likely, 1, {4}, True) == 4
    policy.observe_step(4, 1, 0.011)
    assert policy.cost(4, 1) == pytest.approx(0.012)      # the prior still bounds two samples
    policy.observe_step(4, 1, 0.013)
    assert policy.cost(4, 1) == pytest.approx(0.013)      # settled: the median of its steps
    for _ in range(3):
        policy.observe_step(4, 1, 0.200)
    assert policy.cost(4, 1) == pytest.approx(0.200)
    assert policy.choose_host(likely, 1, {4}, True) == 0
    # what its prior would take, its measured cost forbids: every REMEASURE_FIRST such steps it runs
    # once more, and that step's time starts its window afresh
    chosen = [policy.choose_host(likely, 1, {4}, True) for _ in range(REMEASURE_FIRST - 1)]
    assert chosen == [0] * (REMEASURE_FIRST - 2) + [4] and policy.steps["remeasured"] == 1
    policy.observe_step(4, 1, 0.011)                   # fast again: the slow spell is forgotten
    assert policy.cost(4, 1) == pytest.approx(0.011)
    assert policy.choose_host(likely, 1, {4}, True) == 4
    # slow again: two more steps settle it, then the next re-measure waits twice as long
    policy.observe_step(4, 1, 0.200)
    policy.observe_step(4, 1, 0.200)
    chosen = [policy.choose_host(likely, 1, {4}, True) for _ in range(2 * REMEASURE_FIRST)]
    assert chosen.count(4) == 1 and chosen[-1] == 4 and policy.steps["remeasured"] == 2


def test_auto_learns_what_the_target_accepts_from_plain_steps_too():
    policy = policy_with_costs(0.010, 0.0101)
    # proposals made at plain steps (the drafted step not chosen: a costly one), then contradicted
    costly = policy_with_costs(0.010, 0.100)
    for _ in range(20):
        assert costly.choose_host({0: proposal(1.0, 1.0)}, 1, {4}, True) == 0
        costly.observe_tokens(0, [99])               # the target went elsewhere at once
    assert costly.calibration() < 0.2
    # verified blocks count too: all accepted raises it
    for _ in range(20):
        assert policy.choose_host({0: proposal(0.5, 0.5)}, 1, {4}, True) == 4
        policy.observe_block(0, 4, 4)
    assert policy.calibration() > 1.5


def test_auto_compiles_the_drafted_step_only_where_the_job_repays_it():
    def decide(horizon):
        policy = policy_with_costs(0.020, 0.021, horizon_tokens=horizon)
        policy.compile_estimate = 100.0
        return policy.choose_host({0: proposal(1.0, 1.0, 1.0, 1.0)}, 1, set(), True)
    # saving ~14 ms a token (gain from one step of EMA: small) needs ~10^5 tokens to repay 200 s
    assert decide(1_000) == 0
    assert decide(10_000_000) == 4


def test_a_variant_compiled_after_the_warm_up_is_timed_before_the_next_run():
    """host_policy.refresh: K's warm-up figure was estimated from eager time (not compiled then); once
    compiled (a pinned K on the same runner, as in bench) the next run's warm-up times it."""
    from types import SimpleNamespace

    from specgen.pipelines.host_policy import refresh

    policy = policy_with_costs(0.010, 0.050)
    policy.estimated.add((1, 4))
    calls = []
    compiled = set()
    functions = SimpleNamespace(state=SimpleNamespace(active=torch.ones(1, dtype=torch.bool)),
                                device=torch.device("cpu"), verify_ready=lambda t: t in compiled,
                                verify=lambda kv_len, t: calls.append(t))
    refresh(policy, functions, 64, 1)
    assert calls == [] and policy.profiled[(1, 4)] == 0.050        # not compiled yet: the estimate stays
    compiled.add(5)
    refresh(policy, functions, 64, 1)
    assert calls and set(calls) == {5} and not functions.state.active.any()
    assert policy.profiled[(1, 4)] < 0.050 and policy.estimated == set()
