"""The check that tells bf16 rounding from a bug (tests/rounding.py), on CPU: float32 against bf16
plain decoding parts only at near-ties; a run with one token swapped for a poor one is caught."""

from __future__ import annotations

import pytest
import torch
from checkpoints import tiny_llama_config, write_llama_checkpoint
from rounding import first_differences, rounding_problems
from test_speculative import prompts, run

from specgen.job import build_runner, resolve
from specgen.recipe import recipe_from_dict


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    config = tiny_llama_config(vocab_size=512, hidden_size=128, num_attention_heads=8,
                               num_key_value_heads=2, intermediate_size=256)
    return write_llama_checkpoint(tmp_path_factory.mktemp("rounding") / "target", config)


def plain(target, dtype: str, ids):
    recipe = recipe_from_dict({
        "target": {"model": str(target), "dtype": dtype}, "draft": {"method": "none"},
        "sampling": {"max_tokens": 40, "ignore_eos": True, "seed": 7},
        "runtime": {"device": "cpu", "batch_size": 4, "max_seq_len": 256, "compile": False},
        "chat_template": False})
    runner, _, _ = build_runner(recipe, resolve(recipe), 7)
    try:
        return run(runner, ids, 40)[0]
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
