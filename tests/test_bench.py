"""`specgen bench` end to end on tiny checkpoints: the table, a JSON report with every field, the PNG."""

from __future__ import annotations

import json

import yaml
from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint
from typer.testing import CliRunner

from specgen.bench.report import FIELDS
from specgen.cli import app


def test_bench_compares_a_draft_with_ar_and_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    config = tiny_llama_config(vocab_size=300)
    target = write_llama_checkpoint(tmp_path / "target", config)
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", tiny_eagle3_config(config, draft_vocab_size=200), config)
    recipe = tmp_path / "spec.yaml"
    recipe.write_text(yaml.safe_dump({
        "target": {"model": str(target)},
        "draft": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2},
        "runtime": {"device": "cpu", "max_seq_len": 128, "compile": False, "threads": 1},
        "chat_template": False}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i} " * (i + 1)}) + "\n" for i in range(4)))
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["bench", str(recipe), "--prompts", str(prompts), "--limit", "3",
                                      "--batch-sizes", "1,2", "--max-tokens", "6", "--repeats", "2",
                                      "--output", str(out)], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "eagle3 K=2" in result.output and "vs hf" in result.output
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 3 and report["options"]["batch_sizes"] == [1, 2]
    rows = report["results"]
    assert sorted((r["config"], r["batch_size"]) for r in rows) == sorted(
        (c, b) for c in ("ar", "eagle3 K=2", "hf") for b in (1, 2))
    for row in rows:
        assert set(FIELDS) <= row.keys()
        assert len(row["samples"]) == 2 and row["tokens_per_second"] > 0
        assert row["speedup_vs_ar"] > 0 and row["speedup_vs_hf"] > 0
    spec = next(r for r in rows if r["config"] == "eagle3 K=2")
    assert spec["mean_acceptance_length"] >= 1 and len(spec["acceptance_rate_per_position"]) == 2
    assert sum(spec["acceptance_histogram"]) == spec["num_drafts"] > 0
    assert {"target", "verify", "draft", "host", "total"} <= spec["split_ms"].keys()
    ar = next(r for r in rows if r["config"] == "ar" and r["batch_size"] == 1)
    assert ar["speedup_vs_ar"] == 1.0 and ar["mean_acceptance_length"] is None
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
