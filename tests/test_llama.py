"""Our Llama code against transformers' LlamaForCausalLM on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import tiny_llama_config, write_llama_checkpoint

from specgen.checkpoints import CheckpointError, read_config, resolve_checkpoint
from model_calls import logits

from specgen.checkpoints.loading import load_target

CONFIGS = {
    # Llama-3.1 layout: llama3 rope scaling, GQA, untied head, hub spelling of the config
    "llama3-untied": (tiny_llama_config(), {}),
    # tied head and an explicit head_dim that is not hidden / heads, transformers-5 spelling
    "tied-explicit-head-dim": (tiny_llama_config(tie_word_embeddings=True, head_dim=24,
                                                 rope_scaling=None), {"spelling": "transformers5"}),
    # no GQA, plain rope, weights in several shards
    "mha-sharded": (tiny_llama_config(num_key_value_heads=4, rope_scaling=None),
                    {"shard_bytes": 40_000}),
}


def load_both(folder):
    from transformers import LlamaForCausalLM

    folder = resolve_checkpoint(str(folder))
    ours = load_target(read_config(folder), folder, dtype=torch.float32, device="cpu", dummy=False)
    theirs = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ours, theirs


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(tmp_path, name):
    config, kwargs = CONFIGS[name]
    folder = write_llama_checkpoint(tmp_path / name, config, **kwargs)
    if "shard_bytes" in kwargs:
        assert (folder / "model.safetensors.index.json").is_file()
    ours, theirs = load_both(folder)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config["vocab_size"], (2, 40), generator=gen)
    with torch.no_grad():
        expected = theirs(tokens).logits
        # Prefill 30 tokens into slots 1 and 0 (other rows of the cache), then 10 more in one pass.
        cache = ours.new_cache(3, 64, torch.float32, "cpu")
        slots = torch.tensor([1, 0])
        pos = torch.arange(40).expand(2, 40)
        first, _ = logits(ours, tokens[:, :30], pos[:, :30], cache, 64, rows=slots)
        second, _ = logits(ours, tokens[:, 30:], pos[:, 30:], cache, 64, rows=slots)
    got = torch.cat((first, second), 1)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def test_rows_of_different_lengths_decode_independently(tmp_path):
    """Per-row positions: a batch step over slots at different lengths equals each alone."""
    config = tiny_llama_config()
    ours, theirs = load_both(write_llama_checkpoint(tmp_path / "m", config))
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 96, (1, 17), generator=gen), torch.randint(0, 96, (1, 9), generator=gen)
    with torch.no_grad():
        cache = ours.new_cache(2, 64, torch.float32, "cpu")
        logits(ours, a[:, :-3], torch.arange(14)[None], cache, 64, rows=torch.tensor([0]))
        logits(ours, b[:, :-3], torch.arange(6)[None], cache, 64, rows=torch.tensor([1]))
        step = torch.cat((a[:, -3:], b[:, -3:]))
        positions = torch.stack((torch.arange(14, 17), torch.arange(6, 9)))
        got, _ = logits(ours, step, positions, cache, 64)
        torch.testing.assert_close(got[0], theirs(a).logits[0, -3:], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got[1], theirs(b).logits[0, -3:], atol=2e-5, rtol=1e-4)


def test_captured_layer_ids_name_layer_outputs(tmp_path):
    """Layer id i is HF hidden_states[i + 1] (DESIGN.md section 5), in the order asked."""
    ours, theirs = load_both(write_llama_checkpoint(tmp_path / "m", tiny_llama_config()))
    tokens = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hidden = theirs(tokens, output_hidden_states=True).hidden_states
        cache = ours.new_cache(1, 32, torch.float32, "cpu")
        _, aux = logits(ours, tokens, torch.arange(12)[None], cache, 32, capture=(4, 0, 2))
    expected = torch.cat((hidden[5], hidden[1], hidden[3]), -1)
    torch.testing.assert_close(aux, expected, atol=2e-5, rtol=1e-4)


def test_bad_checkpoints_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="not a known alias"):
        resolve_checkpoint(str(tmp_path / "nothing-here"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_checkpoint(str(tmp_path / "empty"))
    folder = write_llama_checkpoint(tmp_path / "m", tiny_llama_config())
    config = read_config(folder)
    config["num_hidden_layers"] = 7  # the weights have 6
    with pytest.raises(CheckpointError, match="missing model.layers.6"):
        load_target(config, folder, dtype=torch.float32, device="cpu", dummy=False)


def test_dummy_weights_from_config_alone(tmp_path):
    import json

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(tiny_llama_config()))
    folder = resolve_checkpoint(str(tmp_path / "cfg"), needs_weights=False)
    a = load_target(read_config(folder), folder, dtype=torch.float32, device="cpu", dummy=True)
    b = load_target(read_config(folder), folder, dtype=torch.float32, device="cpu", dummy=True)
    torch.testing.assert_close(a.lm_head.weight, b.lm_head.weight)  # deterministic
    assert a.lm_head.weight.std() > 0.01


def test_dummy_weights_keep_a_tied_head_one_tensor():
    config = tiny_llama_config(tie_word_embeddings=True)
    model = load_target(config, None, dtype=torch.bfloat16, device="cpu", dummy=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight.std() > 0.01
    assert model.inv_freq.dtype == torch.float32        # computed, never cast with the weights
