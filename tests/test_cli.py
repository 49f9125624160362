"""`specgen run` end to end on tiny checkpoints: outputs, stats, resume, overrides, errors."""

from __future__ import annotations

import json

import pytest
import yaml
from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint
from typer.testing import CliRunner

from specgen.cli import app


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    config = tiny_llama_config(vocab_size=300)  # byte tokenizer ids 3..258 must exist
    target = write_llama_checkpoint(root / "target", config)
    draft = write_eagle3_checkpoint(root / "eagle3", tiny_eagle3_config(config, draft_vocab_size=200), config)
    prompts = root / "prompts.jsonl"
    lines = [json.dumps({"id": "a", "prompt": "hello there"}),
             "{not json",
             json.dumps({"id": "b", "prompt": "one two three four", "max_tokens": 5}),
             json.dumps({"id": "c", "messages": [{"role": "user", "content": "hi"}]}),
             json.dumps({"question_id": 81, "turns": ["write a poem", "now shorter"]}),
             json.dumps({"id": "long", "prompt": "x" * 200})]
    prompts.write_text("\n".join(lines) + "\n")
    return root, target, draft, prompts


def write_recipe(root, target, draft, **extra):
    recipe = {
        "target": {"model": str(target)},
        "draft": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2},
        "sampling": {"max_tokens": 12, "seed": 1, "ignore_eos": True},
        "runtime": {"device": "cpu", "batch_size": 2, "max_seq_len": 128},
        "chat_template": False,
    }
    recipe.update(extra)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def invoke(*args):
    return CliRunner().invoke(app, list(args), terminal_width=120)


def read_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_results_and_stats_then_resumes(setup):
    root, target, draft, prompts = setup
    recipe = write_recipe(root, target, draft)
    out = root / "out.jsonl"
    result = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(out))
    # finished, with two error records (a bad line, a prompt too long): exit 3, not 0 and not a crash
    assert result.exit_code == 3, result.output
    assert "2 of 6 records are errors" in result.output
    # the header says what runs where; this short job chose eager by itself and says why
    header = next(line for line in result.output.splitlines() if line.startswith("specgen: "))
    assert "cpu" in header and "thread" in header and "batch 2" in header and "eagle3 K=2" in header
    assert "compile off (auto: about" in header and "too few to pay back" in header
    records = {r["id"]: r for r in read_lines(out)}
    assert set(records) == {"a", "b", "c", "81", "line-2", "long"}
    assert records["line-2"]["finish_reason"] == "error"
    assert "prompts.jsonl line 2: not valid JSON" in records["line-2"]["error"]
    assert records["long"]["finish_reason"] == "error" and "max_seq_len" in records["long"]["error"]
    assert records["b"]["num_output_tokens"] == 5 and records["b"]["finish_reason"] == "length"
    a = records["a"]
    assert a["num_output_tokens"] == 12 and len(a["token_ids"]) == 12
    assert set(a["spec"]) >= {"num_drafts", "num_draft_tokens", "num_accepted_tokens",
                              "mean_acceptance_length", "acceptance_histogram", "accepted_per_position"}
    assert a["spec"]["num_draft_tokens"] == 2 * a["spec"]["num_drafts"]
    stats = json.loads((root / "out.jsonl.stats.json").read_text())
    assert stats["requests"] == 6 and stats["errors"] == 2 and stats["complete"]
    assert stats["output_tokens"] == sum(r["num_output_tokens"] for r in records.values())
    assert stats["recipe"]["draft"]["method"] == "eagle3" and "torch" in stats["versions"]
    assert stats["compiled"] is False and stats["compile_seconds"] == 0 and stats["threads"] >= 1
    assert stats["prompt_tokens"] > 0 and stats["prefill_calls"] >= 1

    again = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(out))
    assert again.exit_code == 3, again.output
    assert "already done" in again.output
    assert len(read_lines(out)) == 6  # nothing written twice
    # the rerun generated nothing, and its stats still cover every record of the output
    rerun = json.loads((root / "out.jsonl.stats.json").read_text())
    assert rerun["this_run"]["requests"] == 0 and rerun["this_run"]["resumed_past"] == 6
    for key in ("requests", "errors", "output_tokens", "prompt_tokens", "spec"):
        assert rerun[key] == stats[key], key


def test_draft_method_none_gives_identical_greedy_tokens(setup):
    root, target, draft, prompts = setup
    recipe = write_recipe(root, target, draft)
    spec_out, plain_out = root / "spec.jsonl", root / "plain.jsonl"
    # exit 3: these prompts hold two bad records
    assert invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(spec_out)).exit_code == 3
    result = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(plain_out),
                    "--set", "draft.method=none")
    assert result.exit_code == 3, result.output
    spec = {r["id"]: r["token_ids"] for r in read_lines(spec_out)}
    plain = {r["id"]: r["token_ids"] for r in read_lines(plain_out)}
    assert spec == plain and any(spec.values())


def test_records_carry_the_logprobs_asked_for(setup):
    root, target, draft, prompts = setup
    recipe = write_recipe(root, target, draft)
    out = root / "logprobs.jsonl"
    result = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(out),
                    "--set", "sampling.logprobs=2", "--set", "sampling.prompt_logprobs=1")
    assert result.exit_code == 3, result.output
    records = {r["id"]: r for r in read_lines(out)}
    a = records["a"]
    assert [e["token_id"] for e in a["logprobs"]] == a["token_ids"]
    assert all(e["logprob"] <= 0 and len(e["top"]) == 2 for e in a["logprobs"])
    assert len(a["prompt_logprobs"]) == a["num_prompt_tokens"] and a["prompt_logprobs"][0] is None
    assert all(len(e["top"]) == 1 for e in a["prompt_logprobs"][1:])
    assert records["line-2"]["logprobs"] is None        # an error record has the fields, empty
    plain = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(root / "none.jsonl"))
    assert plain.exit_code == 3 and read_lines(root / "none.jsonl")[0]["logprobs"] is None


def test_stop_strings_cut_the_text(setup):
    root, target, draft, prompts = setup
    recipe = write_recipe(root, target, draft)
    out = root / "free.jsonl"
    assert invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(out), "--limit", "1").exit_code == 0
    text = read_lines(out)[0]["text"]
    stop = text[3:5]
    assert len(stop) == 2
    cut = root / "cut.jsonl"
    result = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(cut), "--limit", "1",
                    "--set", f"sampling.stop={json.dumps([stop])}")
    assert result.exit_code == 0, result.output
    record = read_lines(cut)[0]
    assert record["finish_reason"] == "stop"
    assert record["text"] == text[: text.index(stop)]


def test_a_prompt_line_that_is_not_utf8_is_an_error_result_and_the_others_are_answered(setup, tmp_path):
    root, target, draft, _ = setup
    prompts = tmp_path / "bytes.jsonl"
    prompts.write_bytes(b'{"id": "u1", "prompt": "hello"}\n{"id": "u2", "prompt": "\xff\xfe bad bytes"}\n')
    out = tmp_path / "out.jsonl"
    result = invoke("run", str(write_recipe(root, target, draft)), "--prompts", str(prompts),
                    "--output", str(out))
    assert result.exit_code == 3, result.output
    records = {r["id"]: r for r in read_lines(out)}
    assert set(records) == {"u1", "line-2"}
    assert records["u1"]["finish_reason"] == "length" and records["u1"]["num_output_tokens"] == 12
    assert records["line-2"]["error"] == "bytes.jsonl line 2: not valid UTF-8 (byte 0xff at byte 25 of the line)"


def test_bad_recipe_exits_2_before_loading(setup):
    root, target, draft, _ = setup
    recipe = write_recipe(root, target, draft)
    result = invoke("run", str(recipe), "--set", "draft.num_speculative_tokens=0")
    assert result.exit_code == 2
    assert "recipe.draft.num_speculative_tokens: must be >= 1" in result.output
    result = invoke("run", str(recipe), "--set", "runtime.batchsize=3")
    assert result.exit_code == 2 and "recipe.runtime.batchsize: unknown key" in result.output


def test_memory_estimate_stops_a_run_that_cannot_fit(setup):
    root, target, draft, prompts = setup
    recipe = write_recipe(root, target, draft)
    out = root / "huge.jsonl"
    result = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(out),
                    "--set", "runtime.batch_size=100000", "--set", "runtime.max_seq_len=100000")
    assert result.exit_code == 1
    assert "runtime.batch_size" in result.output and "GiB" in result.output
    assert not out.exists()


def test_ctrl_c_keeps_whole_lines_and_the_rerun_resumes(setup, tmp_path):
    """SIGINT mid-run: exit 130, every written line whole, stats written; rerunning finishes the rest."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root, target, draft, _ = setup
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"count {i}"}) + "\n" for i in range(200)))
    recipe = write_recipe(tmp_path, target, draft)
    out = tmp_path / "many-out.jsonl"
    cmd = [sys.executable, "-m", "specgen.cli", "run", str(recipe), "--prompts", str(prompts), "--output", str(out),
           "--set", "sampling.max_tokens=4", "--set", "runtime.compile=false"]
    # A narrow terminal and a long temp path must not split the hint the test reads.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), COLUMNS="40")
    # A shell's background job starts with SIGINT ignored, and Python then keeps ignoring it: give the
    # child the default disposition so the test means the same under any parent.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "run the same command again to resume" in output
    first = read_lines(out)  # raises if any line is torn
    assert 3 <= len(first) < 200
    stats = json.loads((tmp_path / "many-out.jsonl.stats.json").read_text())
    assert stats["complete"] is False and stats["requests"] == len(first)

    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    ids = [r["id"] for r in read_lines(out)]
    assert sorted(ids) == sorted(f"q{i}" for i in range(200)) and len(ids) == len(set(ids))


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_every_draft_method_gives_the_plain_greedy_tokens(setup, method):
    """The registry routes each method into the same step; random-init drafts stay lossless."""
    root, target, draft, prompts = setup
    recipe = write_recipe(root, target, draft)
    plain_out, spec_out = root / f"plain-{method}.jsonl", root / f"{method}.jsonl"
    assert invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(plain_out),
                  "--set", "draft.method=none").exit_code == 3      # two bad records among the prompts
    result = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(spec_out),
                    "--set", f"draft.method={method}", "--set", "draft.load_format=dummy",
                    "--set", "draft.model=null", "--set", "draft.num_speculative_tokens=3")
    assert result.exit_code == 3, result.output
    assert "RANDOMLY INITIALISED" in result.output
    spec = {r["id"]: r["token_ids"] for r in read_lines(spec_out)}
    assert spec == {r["id"]: r["token_ids"] for r in read_lines(plain_out)}
    assert sum(r["spec"]["num_draft_tokens"] for r in read_lines(spec_out) if r["spec"]) > 0


def test_mtp_without_a_model_needs_mtp_layers_in_the_target(setup):
    root, target, draft, prompts = setup
    recipe = write_recipe(root, target, draft)
    result = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(root / "m.jsonl"),
                    "--set", "draft.method=mtp", "--set", "draft.model=null")
    assert result.exit_code == 2
    assert "needs MTP layers in the target checkpoint" in result.output
