"""The real embedded model, SmolLM2-135M-Instruct (converted once from its GGUF): our code against
transformers on the same weights."""

from __future__ import annotations

import pytest
import torch
from model_calls import logits

from specgen.checkpoints import read_config, resolve_checkpoint
from specgen.job import build_runner, resolve
from specgen.checkpoints.loading import load_target
from specgen.pipelines.runner import Request
from specgen.recipe import recipe_from_dict

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_checkpoint("smollm2-135m-instruct")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, reference, AutoTokenizer.from_pretrained(folder)


def test_conversion_is_an_hf_folder(smollm2):
    folder, _, tokenizer = smollm2
    config = read_config(folder)
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert tokenizer.chat_template is not None


def test_logits_match_transformers(smollm2):
    folder, reference, tokenizer = smollm2
    ours = load_target(read_config(folder), folder, dtype=torch.float32, device="cpu", dummy=False)
    for text in PROMPTS:
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.no_grad():
            expected = reference(ids).logits
            cache = ours.new_cache(1, 64, torch.float32, "cpu")
            got, _ = logits(ours, ids, torch.arange(ids.shape[1])[None], cache, 64)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["none", "eagle3"])
def test_greedy_continuation_matches_transformers_generate(smollm2, method):
    folder, reference, tokenizer = smollm2
    n_new = 24
    expected = {}
    for i, text in enumerate(PROMPTS):
        ids = torch.tensor([tokenizer.encode(text)])
        out = reference.generate(ids, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False)
        expected[f"p{i}"] = out[0, ids.shape[1]:].tolist()
    recipe = recipe_from_dict({
        "target": {"model": "smollm2-135m-instruct", "dtype": "float32"},   # transformers runs float32
        "draft": {"method": method, "load_format": "dummy", "num_speculative_tokens": 3},
        "sampling": {"max_tokens": n_new, "ignore_eos": True},
        "runtime": {"device": "cpu", "batch_size": 2, "max_seq_len": 256},
    })
    runner, _, _ = build_runner(recipe, resolve(recipe), 0)
    got = {}
    requests = [Request(f"p{i}", tokenizer.encode(t), n_new, i) for i, t in enumerate(PROMPTS)]
    runner.run(requests, lambda c: got.__setitem__(c.id, c.token_ids))
    assert got == expected
