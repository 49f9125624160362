"""The check that tells bf16 rounding from a bug (tests/rounding.py), on CPU: float32 against bf16
plain decoding parts only at near-ties; a run with one token swapped for a poor one is caught."""

from __future__ import annotations

import pytest
import torch
from checkpoints import tiny_llama_config, write_llama_checkpoint
from rounding import first_differences, rounding_problems, sampled_rounding_problems
from test_speculative import prompts, run

from specgen.job import build_runner, resolve
from specgen.recipe import recipe_from_dict


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    config = tiny_llama_config(vocab_size=512, hidden_size=128, num_attention_heads=8,
                               num_key_value_heads=2, intermediate_size=256)
    return write_llama_checkpoint(tmp_path_factory.mktemp("rounding") / "target", config)


def plain(target, dtype: str, ids, max_tokens=40, **sampling):
    """Plain decoding of `ids` (greedy, or as `sampling` says), seed 7: request id -> tokens."""
    recipe = recipe_from_dict({
        "target": {"model": str(target), "dtype": dtype}, "draft": {"method": "none"},
        "sampling": {"max_tokens": max_tokens, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": 4, "max_seq_len": 256, "compile": False},
        "chat_template": False})
    runner, _, _ = build_runner(recipe, resolve(recipe), 7)
    try:
        return run(runner, ids, max_tokens)[0]
    finally:
        runner.close()


def test_bf16_parts_from_float32_only_at_near_ties_and_a_bad_token_is_caught(target):
    ids = [p + [7 + i] for i, p in enumerate(prompts(vocab=512) * 2)]
    exact, rounded = plain(target, "float32", ids), plain(target, "bfloat16", ids)
    differing = first_differences(rounded, exact)
    assert len(differing) >= 3          # bf16 rounding does part the runs here: the check has work
    assert rounding_problems(target, ids, rounded, exact) == []

    # negative control: one request's token at a position the runs agree on, swapped for the token
    # float32 ranks lowest there
    key = next(k for k in exact if k not in differing)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    t = 5
    with torch.no_grad():
        worst = int(model(torch.tensor([ids[int(key[1:])] + exact[key][:t]])).logits[0, -1].argmin())
    broken = dict(rounded, **{key: exact[key][:t] + [worst] + exact[key][t + 1:]})
    problems = rounding_problems(target, ids, broken, exact)
    assert len(problems) == 1 and problems[0].startswith(f"{key} at token {t}: ")


def sampled(target, dtype: str, ids):
    return plain(target, dtype, ids, 24, temperature=0.8, top_p=0.9)


def test_the_sampled_check_explains_every_token_of_a_run_and_catches_a_bad_one(target):
    """tests/test_gpu.py's bf16 seeded checks lean on `sampled_rounding_problems`: here it rebuilds every
    token of a float32 seeded run from transformers' logits and the keyed noise (so its key and
    position conventions are the runner's), passes bf16 against float32, and catches a swapped token."""
    ids = [p + [7 + i] for i, p in enumerate(prompts(vocab=512))]
    exact = sampled(target, "float32", ids)
    check = {"seed": 7, "temperature": 0.8, "top_p": 0.9}
    assert sampled_rounding_problems(target, ids, exact, exact, ulps=1, positions="all", **check) == []
    # specgen's own float32 model as the reference (the Kimi K2.5 pairings on a GPU) explains them too
    assert sampled_rounding_problems(target, ids, exact, exact, ulps=1, positions="all", ours=True, **check) == []
    rounded = sampled(target, "bfloat16", ids + [p + [9] for p in ids])
    assert sampled_rounding_problems(target, ids, {k: rounded[k] for k in exact}, exact, **check) == []

    key, t = "p1", 6
    unlikely = [tok for tok in range(3, 512) if tok != exact[key][t]][:40]
    found = [sampled_rounding_problems(target, ids, dict(exact, **{key: exact[key][:t] + [tok]}), exact, **check)
             for tok in unlikely]
    assert sum(bool(p) for p in found) >= 35          # a token picked at random is almost never explained
    assert all(p[0].startswith(f"{key} at token {t}: got's ") for p in found if p)
