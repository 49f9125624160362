"""Losslessness of the whole pipeline: speculative output == plain output, and the target's distribution.

Drafts used here:
- a tiny EAGLE-3 checkpoint in the real layout with random weights (the real draft path; it rarely
  agrees with the target, so acceptance is low);
- an *oracle* test double that proposes the plain run's own continuation, corrupted at fixed
  positions, so that acceptance lengths cover 0..K and every accept / reject / bonus path is taken.
"""

from __future__ import annotations


import pytest
import torch
from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint
from model_calls import logits as forward_logits
from scipy.stats import chisquare

from specgen.job import build_runner, resolve
from specgen.pipelines.requests import Request
from specgen.pipelines.runner import Runner
from specgen.pipelines.unified import UnifiedStep
from specgen.recipe import recipe_from_dict
from specgen.sampling import SamplingTensors, process_logits

PROMPT_LENGTHS = (3, 11, 6, 17, 1, 8)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target_config = tiny_llama_config()
    target = write_llama_checkpoint(root / "target", target_config)
    draft = write_eagle3_checkpoint(root / "eagle3", tiny_eagle3_config(target_config), target_config)
    return target, draft


def make_recipe(target, draft=None, k=3, batch=4, stochastic=False, compile=False, device="cpu", **sampling):
    data = {
        # float32 on every CPU (auto takes bf16 where the CPU has it): the same numbers everywhere
        "target": {"model": str(target), "dtype": "float32"},
        "draft": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": k,
                  "stochastic": stochastic} if draft else {"method": "none"},
        "sampling": {"max_tokens": 24, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": str(device), "batch_size": batch, "max_seq_len": 96, "compile": compile},
        "chat_template": False,
    }
    return recipe_from_dict(data)


def prompts(vocab=96, lengths=PROMPT_LENGTHS):
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def run(runner: Runner, prompt_ids, max_tokens=24, ids=None):
    results, counters = {}, {}
    requests = [Request(ids[i] if ids else f"p{i}", p, max_tokens, request_key=1000 + i)
                for i, p in enumerate(prompt_ids)]

    def done(c):
        assert c.finish_reason != "error", c.error
        results[c.id] = c.token_ids
        counters[c.id] = c.spec

    runner.run(requests, done)
    return results, runner.totals


def runner_for(recipe, draft_override=None):
    r = resolve(recipe)
    runner, _, _ = build_runner(recipe, r, recipe.sampling.seed)
    if draft_override is not None:
        step = UnifiedStep(runner.unified.target, draft_override, logprobs=runner.unified.logprobs,
                           prompt_logprobs=runner.unified.prompt_logprobs)
        runner = Runner(step, batch_size=runner.batch_size, max_seq_len=runner.max_seq_len,
                        rules=runner.rules, sampling=runner.sampling, seed=runner.seed,
                        device=runner.device, dtype=torch.float32)
    return runner


class ReferenceCache:
    """The oracle's per-slot state (a Cache: slot = dim 0): each slot's reference continuation."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def tensors(self):
        return [self.table]

    def narrow(self, slots):
        return ReferenceCache(self.table[:slots])


class OracleDraft(torch.nn.Module):
    """Proposes the reference continuation of each slot, wrong at positions 0, 2, 3 mod 13: runs of
    one and of nine right tokens, so blocks of every acceptance length 0..K occur."""

    aux_layer_ids = ()

    def __init__(self, references: dict[tuple, list[int]], k: int, vocab: int, wrong=None) -> None:
        super().__init__()
        self.references, self.num_speculative_tokens, self.vocab = references, k, vocab
        self.wrong = wrong_positions if wrong is None else wrong

    def new_cache(self, slots, max_len, dtype, device):
        return ReferenceCache(torch.zeros(slots, max_len + 64, dtype=torch.long))

    def propose(self, aux, next_tokens, positions, last_index, cache, attn, pick, k=None):
        k = self.num_speculative_tokens if k is None else k
        if attn.rows is not None:
            store_references(cache.table, self.references, next_tokens, last_index, attn.rows)
        rows = attn.cache_rows(next_tokens.shape[0], next_tokens.device)
        start = positions[torch.arange(len(rows)), last_index] + 2      # position of the first draft
        where = start.unsqueeze(1) + torch.arange(k)
        return spoiled(cache.table[rows.unsqueeze(1), where], where, self.vocab, self.wrong), None


def store_references(table, references, next_tokens, last_index, slots) -> None:
    """At prefill (next_tokens = prompt[1:] + the first token), each slot's reference continuation
    into its row of `table`, found by its prompt."""
    for r, slot in enumerate(slots.tolist()):
        sequence = references[tuple(next_tokens[r, : last_index[r]].tolist())]
        table[slot].zero_()
        table[slot, : len(sequence)] = torch.tensor(sequence)


def wrong_positions(where: torch.Tensor) -> torch.Tensor:
    """Positions 0, 2, 3 mod 13: where the oracle proposes a wrong token by default."""
    return ((where % 13) == 0) | ((where % 13) == 2) | ((where % 13) == 3)


def never_wrong(where: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(where, dtype=torch.bool)


def spoiled(tokens: torch.Tensor, where: torch.Tensor, vocab: int, wrong=wrong_positions) -> torch.Tensor:
    """The reference tokens at positions `where`, changed to a wrong token where `wrong(where)`."""
    return torch.where(wrong(where), (tokens + 1) % vocab, tokens)


def references_of(prompt_ids, plain_results) -> dict[tuple, list[int]]:
    """prompt[1:] -> prompt + its plain output: what an oracle proposes, keyed as prefill finds it."""
    return {tuple(p[1:]): p + plain_results[f"p{i}"] for i, p in enumerate(prompt_ids)}


def oracle_for(prompt_ids, plain_results, k, wrong=None):
    return OracleDraft(references_of(prompt_ids, plain_results), k, 96, wrong)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_greedy_plain(models, k):
    target, draft = models
    ids = prompts()
    plain, _ = run(runner_for(make_recipe(target)), ids)
    eagle, eagle_totals = run(runner_for(make_recipe(target, draft, k=k)), ids)
    assert eagle == plain
    assert eagle_totals.spec.num_drafts > 0
    oracle, totals = run(runner_for(make_recipe(target, draft, k=k), oracle_for(ids, plain, k)), ids)
    assert oracle == plain
    # The oracle makes every acceptance length happen; without it this test could pass vacuously.
    assert totals.spec.acceptance_histogram[0] > 0 and totals.spec.acceptance_histogram[k] > 0
    assert totals.spec.mean_acceptance_length > 1.5


@pytest.mark.parametrize("batch", [1, 4])
def test_seeded_sampled_speculative_equals_seeded_plain(models, batch):
    target, draft = models
    ids = prompts()
    sampling = {"temperature": 0.8, "top_p": 0.9}
    plain, _ = run(runner_for(make_recipe(target, batch=batch, **sampling)), ids)
    plain_b1, _ = run(runner_for(make_recipe(target, batch=1, **sampling)), ids)
    assert plain == plain_b1  # position-keyed noise: the batch size changes nothing
    greedy, _ = run(runner_for(make_recipe(target, batch=batch)), ids)
    assert plain != greedy    # and sampling really happened
    eagle, _ = run(runner_for(make_recipe(target, draft, k=3, batch=batch, **sampling)), ids)
    assert eagle == plain
    oracle, totals = run(runner_for(make_recipe(target, draft, k=3, batch=batch, **sampling),
                                    oracle_for(ids, plain, 3)), ids)
    assert oracle == plain
    assert totals.spec.mean_acceptance_length > 1.5


def test_different_seeds_differ_and_same_seed_repeats(models):
    target, _ = models
    ids = prompts()
    a, _ = run(runner_for(make_recipe(target, temperature=1.0)), ids)
    b, _ = run(runner_for(make_recipe(target, temperature=1.0)), ids)
    c, _ = run(runner_for(make_recipe(target, temperature=1.0, seed=8)), ids)
    assert a == b and a != c


# ------------------------------------------------------------------------- distribution (chi-square)

STAT_VOCAB = 24


@pytest.fixture(scope="module")
def small_vocab_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stat")
    config = tiny_llama_config(vocab_size=STAT_VOCAB)
    target = write_llama_checkpoint(root / "target", config, seed=5)
    draft_config = tiny_eagle3_config(config, draft_vocab_size=16)
    draft = write_eagle3_checkpoint(root / "eagle3", draft_config, config, seed=9)
    return target, draft


def exact_marginals(runner: Runner, prompt: list[int], steps: int, allowed=None) -> list[torch.Tensor]:
    """Marginal distributions of output tokens 1..steps under the PROCESSED target distribution;
    `allowed`: a [V] bool tensor per output position (a grammar's mask, the same after any prefix),
    applied to the logits before processing as the structured step applies its masks."""
    model, sampling = runner.unified.target, runner.sampling.select(torch.tensor([0]))
    marginals, joint = [], torch.ones(1)
    prefixes = [()]
    for _ in range(steps):
        seqs = torch.tensor([prompt + list(p) for p in prefixes])
        n, length = seqs.shape
        cache = model.new_cache(n, 64, torch.float32, "cpu")
        with torch.no_grad():
            logits, _ = forward_logits(model, seqs, torch.arange(length).expand(n, length), cache, 64)
            logits = logits[:, -1:]
        if allowed is not None:
            logits = logits.masked_fill(~allowed[len(marginals)], float("-inf"))
        rows = SamplingTensors.build([float(sampling.temperature[0])] * n, [int(sampling.top_k[0])] * n,
                                     [float(sampling.top_p[0])] * n, [float(sampling.min_p[0])] * n, "cpu")
        cond = process_logits(logits, rows)[:, 0].exp()                   # [n, V]
        step_joint = joint.unsqueeze(1) * cond                            # [n, V]
        marginals.append(step_joint.sum(0))
        joint = step_joint.reshape(-1)
        prefixes = [p + (v,) for p in prefixes for v in range(STAT_VOCAB)]
    return marginals


def chi_square_p(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    expected = probs.double() / probs.double().sum() * len(samples)
    # Pool the rare cells so every expected count is >= 5 (the test's validity condition).
    order = torch.argsort(expected, descending=True)
    obs, exp, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():
        acc_o, acc_e = acc_o + counts[i].item(), acc_e + expected[i].item()
        if acc_e >= 5:
            obs.append(acc_o), exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        obs[-1] += acc_o
        exp[-1] += acc_e
    exp_t = torch.tensor(exp, dtype=torch.float64)
    exp_t *= sum(obs) / exp_t.sum()  # float rounding only; the totals are equal by construction
    return float(chisquare(obs, exp_t.tolist()).pvalue)


@pytest.mark.parametrize("sampling", [{"temperature": 1.0}, {"temperature": 1.0, "top_k": 10, "top_p": 0.85}],
                         ids=["t1", "t1-topk-topp"])
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic-draft", "argmax-draft"])
def test_sampled_speculative_output_has_the_target_distribution(small_vocab_models, sampling, stochastic):
    target, draft = small_vocab_models
    prompt = [5, 9, 2, 17, 11]
    n = 3000
    recipe = make_recipe(target, draft, k=2, batch=64, stochastic=stochastic, **sampling)
    runner = runner_for(recipe)
    results, totals = run(runner, [prompt] * n, max_tokens=3, ids=[f"r{i}" for i in range(n)])
    # drafts do get accepted (a random draft's argmax rarely equals a sampled token, its samples do)
    assert totals.spec.num_accepted_tokens > (0.1 if stochastic else 0.005) * totals.spec.num_draft_tokens
    marginals = exact_marginals(runner, prompt, 3)
    for position, probs in enumerate(marginals):
        samples = [results[f"r{i}"][position] for i in range(n)]
        assert chi_square_p(samples, probs) > 1e-3, f"output token {position + 1} is off-distribution"


def accepting_everything(honest):
    """A lossy verify (a classic bug): every draft accepted, then the honest rule's token after them."""

    def verify(logprobs, drafts, draft_probs, greedy, key, positions, **flags):
        accepted, emitted, _ = honest(logprobs, drafts, draft_probs, greedy, key, positions, **flags)
        k = drafts.shape[1]
        bonus = emitted.gather(1, accepted.unsqueeze(1))
        return torch.full_like(accepted, k), torch.cat((drafts, bonus), 1), torch.zeros_like(accepted)

    return verify


def test_distribution_test_catches_a_lossy_verifier(small_vocab_models, monkeypatch):
    """Negative control: accepting every stochastic draft (a classic bug) must fail the same test."""
    import specgen.pipelines.unified as unified

    target, draft = small_vocab_models
    prompt, n = [5, 9, 2, 17, 11], 3000
    runner = runner_for(make_recipe(target, draft, k=2, batch=64, stochastic=True, temperature=1.0))
    monkeypatch.setattr(unified, "verify", accepting_everything(unified.verify))
    results, _ = run(runner, [prompt] * n, max_tokens=3, ids=[f"r{i}" for i in range(n)])
    monkeypatch.undo()
    marginals = exact_marginals(runner, prompt, 3)
    samples = [results[f"r{i}"][1] for i in range(n)]
    assert chi_square_p(samples, marginals[1]) < 1e-6
