"""`specgen bench` end to end on tiny checkpoints: the table, a JSON report with every field, the PNG."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml
from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint
from step_costs import pin_host_step_costs
from typer.testing import CliRunner

from specgen.bench.report import FIELDS
from specgen.cli import app


def bench_recipe(tmp_path, target, draft: dict) -> Path:
    """A one-recipe bench's recipe (eager, 1 thread)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "target": {"model": str(target), "dtype": "float32"}, "draft": draft,
        "runtime": {"device": "cpu", "max_seq_len": 128, "compile": False, "threads": 1},
        "chat_template": False}))
    return recipe


def bench(tmp_path, target, draft: dict, *args: str):
    """`specgen bench` on a one-recipe job of 4 prompts (eager, 1 thread); returns (result, report path)."""
    recipe = bench_recipe(tmp_path, target, draft)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i} " * (i + 1)}) + "\n" for i in range(4)))
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", str(recipe), "--prompts", str(prompts), *args, "--output", str(out)],
                                terminal_width=200)
    return result, out


def test_bench_compares_a_draft_with_ar_and_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    config = tiny_llama_config(vocab_size=300)
    target = write_llama_checkpoint(tmp_path / "target", config)
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", tiny_eagle3_config(config, draft_vocab_size=200), config)
    result, out = bench(tmp_path, target, {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2},
                        "--limit", "3", "--batch-sizes", "1,2", "--max-tokens", "6", "--repeats", "2",
                        "--ks", "1,auto", "--chunk", "1", "--markdown", str(tmp_path / "table.md"))
    assert result.exit_code == 0, result.output
    assert "eagle3 K=2" in result.output and "vs hf" in result.output
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 3 and report["options"]["batch_sizes"] == [1, 2]
    rows = report["results"]
    configs = ("ar", "eagle3 K=2", "eagle3 K=1", "eagle3 K=auto (0..4)", "hf")
    assert sorted((r["config"], r["batch_size"]) for r in rows) == sorted((c, b) for c in configs for b in (1, 2))
    for row in rows:
        assert set(FIELDS) <= row.keys()
        assert len(row["samples"]) == 2 and row["tokens_per_second"] > 0
        # --chunk 1: at one slot each round ran every configuration prompt by prompt (3 legs); at two
        # slots a leg is at least a batch, and 3 prompts make one
        assert len(row["leg_samples"]) == 2 * (3 if row["batch_size"] == 1 else 1)
        assert row["speedup_vs_ar"] > 0 and row["speedup_vs_hf"] > 0
    # each run's figures were printed as it ended: a bench stopped early has shown what it measured
    for row in rows:
        for n, sample in enumerate(row["samples"], 1):
            assert f"batch {row['batch_size']}: {row['config']}, run {n}: {sample:.1f} tok/s" in result.output
    assert "eagle3 K=2 warmed up in" in result.output and ", acceptance length " in result.output
    spec = next(r for r in rows if r["config"] == "eagle3 K=2")
    assert spec["mean_acceptance_length"] >= 1 and len(spec["acceptance_rate_per_position"]) == 2
    # the Markdown table (docs/performance.md's source): what ran, where, and every row's figures
    assert report["commit"] and report["date"] and "CPUs" in report["cpu"]
    table = (tmp_path / "table.md").read_text().splitlines()
    assert f"commit {report['commit']}, {report['cpu']}, float32" in table[2], table[2]
    body = [line.split(" | ") for line in table[6:]]
    assert len(body) == len(rows)
    for row, cells in zip(rows, body, strict=True):
        config = f"{row['config']} ({row['dtype']})" if row["dtype"] else row["config"]
        assert cells[0] == f"| {row['batch_size']}" and cells[1] == config
        assert cells[2] == f"{row['tokens_per_second']:,.1f}" and cells[3] == f"{row['speedup_vs_ar']:.2f}x"
    assert sum(spec["acceptance_histogram"]) == spec["num_drafts"] > 0
    assert {"target", "verify", "draft", "host", "total"} <= spec["split_ms"].keys()
    # the fixed K settings ran on auto's compiled step (one runner per draft), each with its own k
    for row in rows:
        shared = row["config"] in ("eagle3 K=2", "eagle3 K=1")
        assert row["shares_runner_of"] == ("eagle3 K=auto (0..4)" if shared else None)
    one = next(r for r in rows if r["config"] == "eagle3 K=1" and r["batch_size"] == 1)
    assert len(one["acceptance_rate_per_position"]) == 1 and one["k_histogram"][1] == one["num_drafts"] > 0
    assert len(spec["k_histogram"]) == 3 and spec["k_histogram"][2] == spec["num_drafts"]
    ar = next(r for r in rows if r["config"] == "ar" and r["batch_size"] == 1)
    assert ar["speedup_vs_ar"] == 1.0 and ar["mean_acceptance_length"] is None
    # speed-ups pair the runs of one leg (bench/measure.py: paired_ratio)
    for spec in (r for r in rows if r["config"] == "eagle3 K=2"):
        ar_beside = next(r for r in rows if r["config"] == "ar" and r["batch_size"] == spec["batch_size"])
        paired = [s / a for s, a in zip(spec["leg_samples"], ar_beside["leg_samples"], strict=True)]
        assert spec["speedup_vs_ar"] == pytest.approx(statistics.median(paired))
    assert "batch 1: eagle3 K=2, run 2 of 2, prompts 3-3" in result.output
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hf_baseline_is_transformers_in_a_fresh_process_with_bench_threads(tmp_path, monkeypatch):
    """The hf baseline is transformers the way its users run it: a fresh process, bench's thread count,
    none of specgen's compiler-side machinery loaded. Run inside bench's own process, after specgen's
    configurations, it once went at half the speed it has alone (bench/hf.py). Checked by what the
    child process holds, not by timing it: a timed test fails whenever the machine is busy."""
    import os

    import torch

    from specgen.bench import hf
    from specgen.checkpoints.tokenizer import load_tokenizer

    asked = []

    class Recorded(hf.HFProcess):
        def generate(self, prompts, batch, max_tokens):
            tokens, seconds = super().generate(prompts, batch, max_tokens)
            asked.append((self.about(), prompts, batch, max_tokens, tokens))
            return tokens, seconds

    monkeypatch.setattr(hf, "HFProcess", Recorded)
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    config = tiny_llama_config(vocab_size=300)
    target = write_llama_checkpoint(tmp_path / "target", config)
    result, out = bench(tmp_path, target, {"method": "none"}, "--limit", "3", "--batch-sizes", "1,2",
                        "--max-tokens", "6", "--repeats", "2", "--baselines", "ar,hf")
    assert result.exit_code == 0, result.output
    assert {batch for _, _, batch, _, _ in asked} == {1, 2}    # a warm-up and two runs per batch size
    # on a CPU it runs in the faster of float32 and bf16 (timed on its warm-up prompts), and says which
    dtypes = {r["batch_size"]: r["dtype"] for r in json.loads(out.read_text())["results"] if r["config"] == "hf"}
    assert set(dtypes) == {1, 2} and set(dtypes.values()) <= {"float32", "bfloat16"}
    for batch, dtype in dtypes.items():
        assert f"batch {batch}: hf runs transformers in {dtype} (warm-up prompts: float32 " in result.output
    for facts, _, _, _, _ in asked:
        assert facts["pid"] != os.getpid() and facts["threads"] == 1
        held = [m for m in facts["specgen_modules"] if m.startswith(("specgen.models", "specgen.pipelines.compiled"))]
        assert held == [], held
    # bench's own process holds them: the check tells the two processes apart
    assert "specgen.pipelines.compiled" in hf.process_facts()["specgen_modules"]
    # the child ran the same job an in-process transformers would: the same tokens counted
    tokenizer = load_tokenizer(target, config["vocab_size"])
    alone = {d: hf.HFGenerate(target, torch.device("cpu"), getattr(torch, d), False, tokenizer)
             for d in set(dtypes.values())}
    for _, prompts, batch, max_tokens, tokens in asked:
        assert alone[dtypes[batch]].generate(prompts, batch, max_tokens)[0] == tokens


def test_a_round_runs_its_prompts_in_legs_of_at_least_a_batch():
    from specgen.bench.measure import prompt_legs

    assert prompt_legs(16, 1) == [(0, 4), (4, 8), (8, 12), (12, 16)]      # default: max(batch, 4)
    assert prompt_legs(16, 8) == [(0, 8), (8, 16)]
    assert prompt_legs(16, 16) == [(0, 16)]
    assert prompt_legs(10, 1, 4) == [(0, 4), (4, 10)]       # a short remainder joins the last leg
    assert prompt_legs(3, 1, 1) == [(0, 1), (1, 2), (2, 3)]
    assert prompt_legs(3, 2, 1) == [(0, 3)]                 # never shorter than a batch
    assert prompt_legs(3, 8) == [(0, 3)]


def test_rounds_alternate_their_order_and_speedups_pair_runs_of_one_round():
    from specgen.bench.measure import paired_ratio, round_order

    configs = ["ar", "eagle3 K=2", "eagle3 K=auto"]
    assert [round_order(configs, r) for r in range(3)] == [configs, configs[::-1], configs]
    # every config runs at the same mean position over two rounds: steady drift through a round
    # hits them alike
    positions = {c: sum(round_order(configs, r).index(c) for r in range(2)) for c in configs}
    assert len(set(positions.values())) == 1

    # The machine slows down 30% between rounds; in each round the draft runs 1.25x as fast as ar.
    ar = [100.0, 70.0, 100.0, 70.0]
    spec = [125.0, 87.5, 125.0, 87.5]
    assert paired_ratio(spec, ar) == pytest.approx(1.25)
    # a spell that slows one run of one round moves one ratio, not the median
    assert paired_ratio(spec, [100.0, 70.0, 50.0, 70.0]) == pytest.approx(1.25)
    # ms per step: a step ratio
    assert paired_ratio([30.0, 39.0], [20.0, 26.0]) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        paired_ratio([1.0, 2.0], [1.0])       # every round ran every configuration


def test_a_configuration_that_fails_leaves_the_others_figures(tmp_path, monkeypatch):
    """A variant raising in its warm-up (as `auto` did on the first GPU bench), and one raising in a
    timed run: each reported with its error, the configurations on its runner failed with it, the
    rest measured, the JSON written, exit status 1."""
    import specgen.bench.measure as measure

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    config = tiny_llama_config(vocab_size=300)
    target = write_llama_checkpoint(tmp_path / "target", config)
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", tiny_eagle3_config(config, draft_vocab_size=200), config)
    real = measure._run_specgen
    breaks = {}

    def breaking(runner, prompts, max_tokens, tag, suffix_job=None, response_format=None):
        if runner.unified.draft is not None and breaks["when"](tag, runner.policy):
            raise RuntimeError(breaks["error"])
        return real(runner, prompts, max_tokens, tag, suffix_job, response_format)

    monkeypatch.setattr(measure, "_run_specgen", breaking)
    eagle3 = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    args = ("--limit", "2", "--batch-sizes", "1", "--max-tokens", "4", "--repeats", "2", "--baselines", "ar",
            "--no-split")

    # auto's warm-up: K=1 and K=2 run on auto's runner, so they fail with it
    breaks.update(when=lambda tag, policy: tag == "warm" and not hasattr(policy, "k"),
                  error="The size of tensor a (8) must match the size of tensor b (4)\nat dimension 1")
    result, out = bench(tmp_path, target, eagle3, *args, "--ks", "1,auto")
    assert result.exit_code == 1, result.output
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    auto = rows["eagle3 K=auto (0..4)"]
    assert auto["error"] == "RuntimeError: The size of tensor a (8) must match the size of tensor b (4)"
    assert auto["tokens_per_second"] is None and auto["samples"] == [] and auto["speedup_vs_ar"] is None
    for name in ("eagle3 K=1", "eagle3 K=2"):
        assert rows[name]["error"] == "the runner it shares with eagle3 K=auto (0..4) failed"
        assert rows[name]["samples"] == [] and rows[name]["mean_acceptance_length"] is None
    assert rows["ar"]["error"] is None and len(rows["ar"]["samples"]) == 2 and rows["ar"]["speedup_vs_ar"] == 1.0
    assert "eagle3 K=auto (0..4) FAILED in its warm-up" in result.output
    assert "3 of 4 measurements failed" in result.output

    # a timed run of the second round: what the first measured goes too (no half figures)
    breaks.update(when=lambda tag, policy: tag.startswith("r1"), error="a timed run broke")
    result, out = bench(tmp_path, target, eagle3, *args)
    assert result.exit_code == 1, result.output
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert rows["eagle3 K=2"]["error"] == "RuntimeError: a timed run broke" and rows["eagle3 K=2"]["samples"] == []
    assert rows["ar"]["error"] is None and len(rows["ar"]["samples"]) == 2
    assert "eagle3 K=2 FAILED in run 2" in result.output


def test_a_configuration_that_would_not_fit_in_memory_is_skipped_not_the_bench(tmp_path, monkeypatch):
    """Memory is checked per configuration and batch size, before its runner is built (every runner
    of a batch size stays alive through its rounds): one that would not fit is skipped with why, the
    configuration on its runner with it, the rest measured; exit status 1 (the bench is incomplete)."""
    import specgen.job as job
    import specgen.job.memory as memory
    from specgen.bench.measure import BenchOptions, _bench_recipe
    from specgen.recipe import load_recipe

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    config = tiny_llama_config(vocab_size=300)
    target = write_llama_checkpoint(tmp_path / "target", config)
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", tiny_eagle3_config(config, draft_vocab_size=200), config)
    eagle3 = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    args = ("--limit", "4", "--batch-sizes", "1,4", "--max-tokens", "4", "--repeats", "1", "--baselines", "ar",
            "--no-split", "--ks", "1")

    def runner_bytes(method_draft: dict, batch: int) -> int:
        recipe = load_recipe(bench_recipe(tmp_path, target, method_draft))
        parts = job.estimate_bytes(_bench_recipe(recipe, batch, BenchOptions(max_tokens=4)), job.resolve(recipe))
        return sum(parts.values()) - parts["target weights"]

    # a machine where plain decoding fits at both batch sizes and the draft's runner only at one slot
    fits = max(runner_bytes({"method": "none"}, 4), runner_bytes(eagle3, 1))
    over = runner_bytes(eagle3, 4)
    assert fits < over
    monkeypatch.setattr(memory, "available_bytes", lambda device: (fits + over) / 2 / 0.9)
    result, out = bench(tmp_path, target, eagle3, *args)
    assert result.exit_code == 1, result.output
    rows = {(r["config"], r["batch_size"]): r for r in json.loads(out.read_text())["results"]}
    assert len(rows) == 6
    for config in ("ar", "eagle3 K=2", "eagle3 K=1"):
        assert rows[config, 1]["error"] is None and rows[config, 1]["tokens_per_second"] > 0
    assert rows["ar", 4]["error"] is None and rows["ar", 4]["tokens_per_second"] > 0
    lead, shared = rows["eagle3 K=2", 4], rows["eagle3 K=1", 4]
    assert lead["skipped"] and lead["error"].startswith("needs about") and "beside the 1 runner" in lead["error"]
    assert shared["skipped"] and shared["error"] == "the runner it shares with eagle3 K=2 did not fit"
    assert lead["tokens_per_second"] is None and shared["samples"] == []
    assert "batch 4: eagle3 K=2 SKIPPED before its warm-up: needs about" in result.output
    assert "2 of 6 measurements skipped" in result.output and "failed" not in result.output


def test_suffix_drafting_remembers_a_round_across_its_legs(tmp_path, monkeypatch):
    """A round is one job run in legs: suffix drafting's job-wide index carries over from leg to leg
    (bench/measure.py), so a prompt asked again in a later leg is drafted from its first answer."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    target = write_llama_checkpoint(tmp_path / "target", tiny_llama_config(vocab_size=300))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "target": {"model": str(target), "dtype": "float32"},
        "draft": {"method": "suffix", "num_speculative_tokens": 4},
        "runtime": {"device": "cpu", "max_seq_len": 128, "compile": False, "threads": 1},
        "chat_template": False}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text((json.dumps({"prompt": "tell me 7 things about 19 ducks"}) + "\n") * 3)
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", str(recipe), "--prompts", str(prompts), "--limit", "3",
                                      "--batch-sizes", "1", "--max-tokens", "40", "--repeats", "1",
                                      "--chunk", "1", "--baselines", "ar", "--output", str(out)],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    row = next(r for r in json.loads(out.read_text())["results"] if r["config"] == "suffix K=4")
    assert len(row["leg_samples"]) == 3
    # the second and third answers repeat the first: every block after their opening ones accepts 4
    assert row["mean_acceptance_length"] > 3.0, row


def test_bench_runs_each_configuration_again_under_a_response_format(tmp_path, monkeypatch):
    """--response-format FILE: every configuration (hf aside) twice, free and constrained; a
    constrained one's speed-up is over ar under the same format."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    pin_host_step_costs(monkeypatch)        # jump-forward's choices, not this machine's timings
    config = tiny_llama_config(vocab_size=300)
    target = write_llama_checkpoint(tmp_path / "target", config)
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", tiny_eagle3_config(config, draft_vocab_size=200), config)
    fmt = tmp_path / "format.json"
    fmt.write_text(json.dumps({"type": "regex", "pattern": "[ab]{3}-[0-9]{2}"}))
    result, out = bench(tmp_path, target, {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2},
                        "--limit", "2", "--batch-sizes", "2", "--max-tokens", "12", "--repeats", "1",
                        "--baselines", "ar", "--no-split", "--response-format", str(fmt))
    assert result.exit_code == 0, result.output
    rows = {r["config"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"ar", "eagle3 K=2", "ar +regex", "ar jump-forward +regex", "eagle3 K=2 +regex"}
    assert rows["ar +regex"]["speedup_vs_ar"] == 1.0
    # plain decoding under the format drafts nothing; with jump-forward the forced "-" is verified
    assert rows["ar +regex"]["mean_acceptance_length"] is None
    assert rows["ar jump-forward +regex"]["mean_acceptance_length"] > 1
    constrained = rows["eagle3 K=2 +regex"]
    paired = [s / a for s, a in zip(constrained["leg_samples"], rows["ar +regex"]["leg_samples"], strict=True)]
    assert constrained["speedup_vs_ar"] == pytest.approx(statistics.median(paired))
    # the constrained runs are short (7 tokens and EOS at most) where the free ones run to 12
    assert rows["ar +regex"]["output_tokens"] < rows["ar"]["output_tokens"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "regex"}))
    result, _ = bench(tmp_path, target, {"method": "none"}, "--response-format", str(bad))
    assert result.exit_code == 2 and "bad.json.pattern: expected a non-empty string" in result.output
