"""The target's logprobs of each output token (`sampling.logprobs`, pipelines/logprobs.py).

They must be the target's own (a full forward over prompt + output, processed as the sampler
processes it) and not depend on the draft: the same values with every draft method as without one,
for the first token (the prefill's) and for accepted drafts, corrections and bonus tokens alike (the
oracle draft makes every acceptance length happen).
"""

from __future__ import annotations

import math

import pytest
import torch
from model_calls import logits as forward_logits
from test_draft_vocab import write_reduced_draft
from test_speculative import make_recipe, models, oracle_for, prompts, runner_for  # noqa: F401  (fixture)
from test_training import target, target_dir  # noqa: F401  (fixtures)

from specgen.pipelines.logprobs import logprob_view, pack, unpack
from specgen.pipelines.requests import Request
from specgen.recipe import RecipeError, recipe_from_dict
from specgen.sampling import SamplingTensors, process_logits

TOP = 4
SAMPLINGS = {
    "greedy": {},
    "sampled": {"temperature": 0.8, "top_k": 3, "top_p": 0.9, "min_p": 0.05},      # top_k < TOP: filtered tokens
    "raw": {"temperature": 0.8, "top_k": 20, "logprobs_mode": "raw"},
}


def run(runner, prompt_ids, max_tokens=24):
    """{id: (token_ids, logprobs)} through the real runner."""
    out = {}

    def done(c):
        assert c.finish_reason != "error", c.error
        out[c.id] = (c.token_ids, c.logprobs)

    runner.run([Request(f"p{i}", p, max_tokens, request_key=1000 + i) for i, p in enumerate(prompt_ids)], done)
    return out


def reference(runner, prompt, output, sampling: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The target alone over prompt + output: (the output tokens' logprobs [N], the reported
    distributions [N, V]), processed as the recipe's sampling processes them."""
    model = runner.unified.target
    tokens = torch.tensor([prompt + output])
    length = tokens.shape[1]
    cache = model.new_cache(1, length, torch.float32, "cpu")
    positions = torch.arange(length).unsqueeze(0)
    logits, _ = forward_logits(model, tokens, positions, cache, length)
    logits = logits[:, len(prompt) - 1:length - 1]                                     # [1, N, V]
    params = SamplingTensors.build([sampling.get("temperature", 0.0)], [sampling.get("top_k", 0)],
                                   [sampling.get("top_p", 1.0)], [sampling.get("min_p", 0.0)])
    view = logprob_view(logits, process_logits(logits, params), params, sampling.get("logprobs_mode", "processed"))[0]
    return view.gather(-1, torch.tensor(output).unsqueeze(-1))[:, 0], view


def assert_close_entries(a: list[dict], b: list[dict], tol: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["token_id"] == y["token_id"]
        assert math.isclose(x["logprob"], y["logprob"], abs_tol=tol)
        assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]
        assert all(math.isclose(p, q, abs_tol=tol) for (_, p), (_, q) in zip(x["top"], y["top"]))


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_logprobs_are_the_targets_and_the_same_under_every_draft(models, name):
    target, draft = models
    sampling = {**SAMPLINGS[name], "logprobs": TOP}
    ids = prompts()
    plain_runner = runner_for(make_recipe(target, **sampling))
    plain = run(plain_runner, ids)
    tokens = {key: value[0] for key, value in plain.items()}
    eagle = run(runner_for(make_recipe(target, draft, k=3, **sampling)), ids)
    oracle_runner = runner_for(make_recipe(target, draft, k=3, **sampling), oracle_for(ids, tokens, 3))
    oracle = run(oracle_runner, ids)
    assert oracle_runner.totals.spec.acceptance_histogram[3] > 0     # accepted drafts and bonus tokens too
    for i, prompt in enumerate(ids):
        output, entries = plain[f"p{i}"]
        assert len(entries) == len(output) == 24
        # the target alone, over the whole sequence
        chosen, view = reference(plain_runner, prompt, output, sampling)
        for n, entry in enumerate(entries):
            assert entry["token_id"] == output[n]
            assert math.isclose(entry["logprob"], float(chosen[n]), abs_tol=1e-4)
            assert math.isfinite(entry["logprob"])
            top = view[n].topk(TOP)
            kept = [(t, v) for t, v in zip(top.indices.tolist(), top.values.tolist()) if v != -math.inf]
            assert [t for t, _ in entry["top"]] == [t for t, _ in kept]
            assert all(math.isclose(p, v, abs_tol=1e-4) for (_, p), (_, v) in zip(entry["top"], kept))
        # and the same with a draft, whatever it proposed
        for spec in (eagle, oracle):
            assert spec[f"p{i}"][0] == output
            assert_close_entries(spec[f"p{i}"][1], entries, 1e-5)
    if name == "sampled":         # filtered tokens are left out of `top`: fewer than N pairs somewhere
        assert any(len(e["top"]) < TOP for _, entries in plain.values() for e in entries)


def test_host_drafts_report_the_same_logprobs(models):
    """Suffix drafting: the host's proposals, verified without a draft model."""
    from test_suffix import suffix_recipe

    target, draft = models
    ids = [p * 3 for p in prompts()]              # repeats: the suffix index finds proposals
    sampling = {"temperature": 0.8, "logprobs": 2}
    plain = run(runner_for(make_recipe(target, **sampling)), ids)
    runner = runner_for(suffix_recipe(target, k=3, **sampling))
    spec = run(runner, ids)
    assert runner.totals.spec.num_drafts > 0
    for key, (output, entries) in plain.items():
        assert spec[key][0] == output
        assert_close_entries(spec[key][1], entries, 1e-5)


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_reduced_vocabulary_drafts_report_the_same_logprobs(target, target_dir, tmp_path, method):
    folder = tmp_path / method
    write_reduced_draft(folder, method, target)

    def recipe(draft: dict):
        return recipe_from_dict({
            "target": {"model": str(target_dir), "dtype": "float32"}, "draft": draft,
            "sampling": {"max_tokens": 16, "ignore_eos": True, "seed": 7, "temperature": 0.8, "logprobs": 2},
            "runtime": {"device": "cpu", "batch_size": 4, "max_seq_len": 96, "compile": False},
            "chat_template": False})

    ids = prompts()
    plain = run(runner_for(recipe({"method": "none"})), ids, 16)
    spec_runner = runner_for(recipe({"method": method, "model": str(folder), "num_speculative_tokens": 3}))
    spec = run(spec_runner, ids, 16)
    assert spec_runner.totals.spec.num_drafts > 0
    for key, (output, entries) in plain.items():
        assert spec[key][0] == output
        assert_close_entries(spec[key][1], entries, 1e-5)


def test_pack_and_unpack_round_trip():
    view = torch.log_softmax(torch.tensor([[[0.0, 1.0, -math.inf, 2.0, -math.inf]]]), -1)   # [1, 1, 5]
    packed = pack(view, torch.tensor([[1]]), 4)
    assert packed.dtype == torch.int64 and packed.shape == (1, 1, 9)
    entry = unpack(packed[0, 0].tolist(), 1, 4)
    assert entry["token_id"] == 1 and entry["logprob"] == pytest.approx(float(view[0, 0, 1]))
    assert [t for t, _ in entry["top"]] == [3, 1, 0]          # the two -inf tokens are not "top"
    assert [p for _, p in entry["top"]] == pytest.approx(view[0, 0, [3, 1, 0]].tolist())
    assert unpack(pack(view, torch.tensor([[3]]), 0)[0, 0].tolist(), 3, 0)["top"] == []


@pytest.mark.parametrize(("sampling", "message"), [
    ({"logprobs": 21}, "sampling.logprobs: must be <= 20"),
    ({"logprobs": -1}, "sampling.logprobs: must be >= 0"),
    ({"logprobs": True}, "sampling.logprobs: expected an integer"),
    ({"logprobs": 2, "logprobs_mode": "final"}, "sampling.logprobs_mode: must be one of processed, raw"),
    ({"prompt_logprobs": 30}, "sampling.prompt_logprobs: must be <= 20"),
])
def test_bad_logprobs_settings_are_named(sampling, message):
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict({"target": {"model": "x"}, "sampling": sampling})


@pytest.mark.parametrize("chunk", [16, 512])
def test_prompt_logprobs_are_the_targets_over_the_prompt(models, chunk):
    target, draft = models
    ids = prompts() + [list(range(3, 43))]           # 40 tokens: three chunks of 16
    for recipe in (make_recipe(target, prompt_logprobs=3), make_recipe(target, draft, k=3, prompt_logprobs=3)):
        runner = runner_for(recipe)
        runner.prefill.chunk = chunk
        results = {}
        runner.run([Request(f"p{i}", p, 4, request_key=i) for i, p in enumerate(ids)],
                   lambda c: results.__setitem__(c.id, c))
        for i, prompt in enumerate(ids):
            entries = results[f"p{i}"].prompt_logprobs
            assert len(entries) == len(prompt) and entries[0] is None
            model = runner.unified.target
            tokens = torch.tensor([prompt])
            logits, _ = forward_logits(model, tokens, torch.arange(len(prompt)).unsqueeze(0),
                                       model.new_cache(1, len(prompt), torch.float32, "cpu"), len(prompt))
            view = torch.log_softmax(logits[0], -1)                                   # [T, V]
            for p in range(1, len(prompt)):
                assert entries[p]["token_id"] == prompt[p]
                assert math.isclose(entries[p]["logprob"], float(view[p - 1, prompt[p]]), abs_tol=1e-4)
                top = view[p - 1].topk(3)
                assert [t for t, _ in entries[p]["top"]] == top.indices.tolist()
                assert [v for _, v in entries[p]["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert results[f"p{i}"].logprobs is None          # sampling.logprobs is off
