"""The four DeepSeek-V3 / Kimi K2.5 pairings, end to end through `build_runner` (what `specgen run` uses):

- MTP + DeepSeek-V3 (the MTP layer read from the target checkpoint itself, MLA + MoE block);
- EAGLE-3 + DeepSeek-V3 (a Llama-style GQA draft layer beside the MLA target: two independent caches);
- EAGLE-3 + Kimi K2.5 (the MLA draft layer of nvidia's Kimi-K2.5-Thinking-Eagle3);
- DFlash + Kimi K2.5.

For each: greedy speculative == greedy plain, seeded sampled speculative == seeded plain, and the
sampled output's distribution is the target's (chi-square against the exact marginals; a lossy rule
fails the same test). The compiled step of these pairings, and every acceptance length, are
test_oracle_drafts.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import tiny_eagle3_config, write_eagle3_checkpoint
from checkpoints_deepseek import (
    tiny_deepseek_config,
    tiny_kimi_config,
    tiny_mla_eagle3_config,
    write_deepseek_checkpoint,
    write_kimi_checkpoint,
    write_mla_eagle3_checkpoint,
)
from checkpoints_dflash import tiny_dflash_config, write_dflash_checkpoint
from test_speculative import STAT_VOCAB, accepting_everything, chi_square_p, exact_marginals, prompts, run, runner_for

from specgen.recipe import recipe_from_dict

PAIRINGS = ("deepseek-mtp", "deepseek-eagle3", "kimi-eagle3-mla", "kimi-dflash")


def write_pairings(root, vocab: int) -> dict[str, tuple]:
    """pairing -> (target folder, draft method, draft folder | None, K)."""
    ds_config = tiny_deepseek_config(vocab_size=vocab)
    ds = write_deepseek_checkpoint(root / "deepseek", ds_config)
    kimi_config = tiny_kimi_config(vocab_size=vocab)
    kimi = write_kimi_checkpoint(root / "kimi", kimi_config)
    text = kimi_config["text_config"]
    eagle = tiny_eagle3_config(ds_config, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
                               draft_vocab_size=min(64, vocab - 4))
    mla_eagle = tiny_mla_eagle3_config(text)
    dflash = tiny_dflash_config(text, target_layer_ids=[0, 2], block_size=4)
    return {
        "deepseek-mtp": (ds, "mtp", None, 2),
        "deepseek-eagle3": (ds, "eagle3", write_eagle3_checkpoint(root / "eagle3", eagle, ds_config), 3),
        "kimi-eagle3-mla": (kimi, "eagle3", write_mla_eagle3_checkpoint(root / "mla-eagle3", mla_eagle, text), 3),
        "kimi-dflash": (kimi, "dflash", write_dflash_checkpoint(root / "dflash", dflash), 3),
    }


@pytest.fixture(scope="module")
def pairings(tmp_path_factory):
    return write_pairings(tmp_path_factory.mktemp("pairs"), 96)


@pytest.fixture(scope="module")
def small_vocab_pairings(tmp_path_factory):
    return write_pairings(tmp_path_factory.mktemp("pairs-stat"), STAT_VOCAB)


def recipe(target, method="none", draft=None, k=3, batch=4, stochastic=False, compile=False, **sampling):
    d = {"method": method}
    if method != "none":
        d.update(num_speculative_tokens=k, stochastic=stochastic)
        if draft is not None:
            d["model"] = str(draft)
    return recipe_from_dict({
        "target": {"model": str(target), "dtype": "float32"}, "draft": d,
        "sampling": {"max_tokens": 20, "ignore_eos": True, "seed": 7, **sampling},
        "runtime": {"device": "cpu", "batch_size": batch, "max_seq_len": 80, "compile": compile},
        "chat_template": False,
    })


@pytest.mark.parametrize("name", PAIRINGS)
def test_greedy_speculative_equals_greedy_plain(pairings, name):
    target, method, draft, k = pairings[name]
    ids = prompts()
    plain, _ = run(runner_for(recipe(target)), ids, max_tokens=20)
    spec, totals = run(runner_for(recipe(target, method, draft, k)), ids, max_tokens=20)
    assert spec == plain
    assert totals.spec.num_drafts > 0 and totals.spec.num_speculative_tokens == k


@pytest.mark.parametrize("name", PAIRINGS)
def test_seeded_sampled_speculative_equals_seeded_plain(pairings, name):
    target, method, draft, k = pairings[name]
    ids = prompts()
    sampling = {"temperature": 0.8, "top_p": 0.9}
    plain, _ = run(runner_for(recipe(target, **sampling)), ids, max_tokens=20)
    greedy, _ = run(runner_for(recipe(target)), ids, max_tokens=20)
    assert plain != greedy
    spec, _ = run(runner_for(recipe(target, method, draft, k, **sampling)), ids, max_tokens=20)
    assert spec == plain


@pytest.mark.parametrize("name", PAIRINGS)
def test_sampled_output_has_the_target_distribution(small_vocab_pairings, name):
    target, method, draft, k = small_vocab_pairings[name]
    prompt, n = [5, 9, 2, 17, 11], 2000
    runner = runner_for(recipe(target, method, draft, k=2, batch=64, stochastic=True, temperature=1.0))
    results, totals = run(runner, [prompt] * n, max_tokens=3, ids=[f"r{i}" for i in range(n)])
    assert totals.spec.num_accepted_tokens > 0.05 * totals.spec.num_draft_tokens
    for position, probs in enumerate(exact_marginals(runner, prompt, 3)):
        samples = [results[f"r{i}"][position] for i in range(n)]
        assert chi_square_p(samples, probs) > 1e-3, f"{name}: output token {position + 1} is off-distribution"


@pytest.mark.parametrize("name", PAIRINGS)
def test_the_distribution_test_catches_a_lossy_verifier(small_vocab_pairings, name, monkeypatch):
    """Negative control of the test above, pairing by pairing: with every draft accepted (a lossy
    rule) the same samples leave the target's distribution."""
    import specgen.pipelines.unified as unified

    target, method, draft, k = small_vocab_pairings[name]
    prompt, n = [5, 9, 2, 17, 11], 2000
    runner = runner_for(recipe(target, method, draft, k=2, batch=64, stochastic=True, temperature=1.0))
    monkeypatch.setattr(unified, "verify", accepting_everything(unified.verify))
    results, _ = run(runner, [prompt] * n, max_tokens=3, ids=[f"r{i}" for i in range(n)])
    monkeypatch.undo()
    marginals = exact_marginals(runner, prompt, 3)
    # token 1 is always the target's own sample (prefill); the drafts decide tokens 2 and 3
    worst = min(chi_square_p([results[f"r{i}"][p] for i in range(n)], marginals[p]) for p in (1, 2))
    assert worst < 1e-6, f"{name}: a lossy verifier passed the distribution test"


def test_draft_and_target_caches_are_independent(pairings):
    """GQA drafts beside an MLA target keep K/V caches; the MLA draft layer caches latents like it."""
    from specgen.models.attention import KVCache
    from specgen.models.mla import LatentCache

    kinds = {}
    for name in ("deepseek-eagle3", "kimi-eagle3-mla", "deepseek-mtp"):
        target, method, draft, k = pairings[name]
        caches = runner_for(recipe(target, method, draft, k)).unified.new_caches(2, 16, torch.float32, "cpu")
        kinds[name] = (type(caches.target), type(caches.draft))
    assert kinds["deepseek-eagle3"] == (LatentCache, KVCache)
    assert kinds["kimi-eagle3-mla"] == (LatentCache, LatentCache)
    assert kinds["deepseek-mtp"] == (LatentCache, LatentCache)


RECIPES = {"deepseek-mtp": "deepseek-v3-mtp.yaml", "deepseek-eagle3": "deepseek-v3-eagle3.yaml",
           "kimi-eagle3-mla": "kimi-k25-eagle3.yaml", "kimi-dflash": "kimi-k25-dflash.yaml"}


@pytest.fixture(scope="module")
def cli_pairings(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs-cli")
    prompts_file = root / "prompts.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"id": f"q{i}", "prompt": p})
                                      for i, p in enumerate(["hello there", "one two three", "why?"])) + "\n")
    return root, write_pairings(root, 300), prompts_file   # the byte tokenizer's ids 3..258 must exist


@pytest.mark.parametrize("name", PAIRINGS)
def test_shipped_recipe_runs_through_specgen_run(cli_pairings, name):
    """`specgen run recipes/<pairing>.yaml` with the folders pointed at tiny real-layout checkpoints."""
    from typer.testing import CliRunner

    from specgen.cli import app

    root, pairs, prompts_file = cli_pairings
    target, method, draft, k = pairs[name]
    recipe = Path(__file__).parent.parent / "recipes" / RECIPES[name]
    common = ["--prompts", str(prompts_file), "--set", f"target.model={target}", "--set", "runtime.device=cpu",
              "--set", "runtime.batch_size=2", "--set", "runtime.max_seq_len=64", "--set", "sampling.max_tokens=8",
              "--set", "sampling.ignore_eos=true", "--set", "chat_template=false", "--set", "runtime.compile=false"]
    if draft is not None:
        common += ["--set", f"draft.model={draft}"]
    out, plain_out = root / f"{name}.jsonl", root / f"{name}-plain.jsonl"
    # K pinned to the pairing's: the shipped `auto` decides from measured step times, and on a loaded
    # machine it may rightly run every step of so short a job plain (test_adaptive.py covers it)
    pinned = ["--set", f"draft.num_speculative_tokens={k}", "--set", "draft.max_speculative_tokens=null"]
    result = CliRunner().invoke(app, ["run", str(recipe), "--output", str(out), *common, *pinned],
                                terminal_width=120)
    assert result.exit_code == 0, result.output
    assert f"{method}" in result.output
    if name.startswith("kimi"):   # the vision encoder is named in the log, and never read
        assert "mm_projector, vision_tower weights are not loaded" in " ".join(result.output.split())
    plain = CliRunner().invoke(app, ["run", str(recipe), "--output", str(plain_out), *common,
                                     "--set", "draft.method=none"], terminal_width=120)
    assert plain.exit_code == 0, plain.output
    spec = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    base = {r["id"]: r for r in map(json.loads, plain_out.read_text().splitlines())}
    assert {i: r["token_ids"] for i, r in spec.items()} == {i: r["token_ids"] for i, r in base.items()}
    assert all(len(r["token_ids"]) == 8 for r in spec.values())
    assert sum(r["spec"]["num_drafts"] for r in spec.values()) > 0


def test_dummy_target_with_overrides_runs_its_random_mtp_layer(tmp_path):
    """A bare DeepSeek-V3 config.json, dummy weights, two layers through hf_overrides: the MTP layer
    (DeepSeek block) is built from the target's config with random weights, and stays lossless."""
    from typer.testing import CliRunner

    from specgen.cli import app

    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(tiny_deepseek_config(vocab_size=300, num_hidden_layers=5)))
    recipe = Path(__file__).parent.parent / "recipes" / "deepseek-v3-dummy-mtp.yaml"
    common = ["--set", f"target.model={config_file}", "--set", "target.hf_overrides={num_hidden_layers: 2}",
              "--set", "runtime.device=cpu", "--set", "runtime.compile=false", "--set", "sampling.max_tokens=6",
              "--set", "runtime.max_seq_len=256", "--limit", "2"]
    out, plain_out = tmp_path / "mtp.jsonl", tmp_path / "plain.jsonl"
    result = CliRunner().invoke(app, ["run", str(recipe), "--output", str(out), *common], terminal_width=120)
    assert result.exit_code == 0, result.output
    assert "its mtp layer is random too" in result.output
    plain = CliRunner().invoke(app, ["run", str(recipe), "--output", str(plain_out), *common,
                                     "--set", "draft.method=none"], terminal_width=120)
    assert plain.exit_code == 0, plain.output
    spec = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
    assert spec == [json.loads(line)["token_ids"] for line in plain_out.read_text().splitlines()]
    stats = json.loads((tmp_path / "mtp.jsonl.stats.json").read_text())
    assert stats["recipe"]["target"]["hf_overrides"] == {"num_hidden_layers": 2}
