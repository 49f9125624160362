"""`specgen inspect-checkpoint` and the checks that guard every run.

Every reference layout of tests/layouts, at FULL size, as header-only sparse files
(header_checkpoints.py): each is identified and validated from its headers alone, reading no byte of
tensor data. Broken variants (a missing shard, a truncated file, garbage or a cut in the header, a
missing tensor, a wrong shape, a draft for another vocabulary, layer ids past the target's depth)
are each flagged with a clear reason and the right exit code, by `inspect-checkpoint` and by `run`,
which never shows a traceback for them.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, write_llama_checkpoint
from header_checkpoints import (LAYOUTS, break_garbage_header, break_index, break_missing_shard, break_offsets,
                                break_truncate, break_truncated_header, edit_header, header_bytes, write_layout)
from typer.testing import CliRunner

from specgen.cli import app

EXPECTED = {   # layout -> (role, architecture, method)
    "llama-3.1-8b": ("target", "LlamaForCausalLM", None),
    "deepseek-v3": ("target", "DeepseekV3ForCausalLM", "mtp"),
    "kimi-k2.5": ("target", "KimiK25ForConditionalGeneration", None),
    "eagle3-llama3.1-8b": ("draft", "LlamaForCausalLMEagle3", "eagle3"),
    "kimi-k2.5-eagle3": ("draft", "Eagle3DeepseekV2ForCausalLM", "eagle3"),
    "dflash-qwen3-8b": ("draft", "DFlashDraftModel", "dflash"),
}


def invoke(*args):
    return CliRunner().invoke(app, list(args), terminal_width=160)


def inspect_json(*args) -> tuple[int, dict]:
    result = invoke("inspect-checkpoint", *args, "--json")
    assert_no_crash(result)
    return result.exit_code, json.loads(result.stdout)


def assert_no_crash(result) -> None:
    """An exit code the command chose (CliRunner keeps an uncaught exception in `result.exception`)."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return {name: write_layout(root, name) for name in LAYOUTS}


# ------------------------------------------------------------------------------- every layout, whole


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_reference_layout_is_identified_and_runnable(layouts, name):
    code, report = inspect_json(str(layouts[name]))
    role, architecture, method = EXPECTED[name]
    assert (report["role"], report["architecture"], report["method"]) == (role, architecture, method)
    assert code == 0 and report["runnable"] and report["problems"] == []
    assert report["layout"]["tensors"] == sum(r["tensors"] for r in report["tensors_by_dtype"].values())
    assert report["memory"]["weights_bytes"] > 0 and report["memory"]["kv_cache_bytes_per_token"] > 0


def test_the_figures_that_matter_for_deepseek_v3(layouts):
    code, report = inspect_json(str(layouts["deepseek-v3"]), "--batch-size", "8", "--max-seq-len", "8192")
    fields, memory, by_dtype = report["fields"], report["memory"], report["tensors_by_dtype"]
    assert fields["layers"] == 61 and fields["kv_lora_rank"] == 512 and fields["routed experts"] == 256
    assert fields["mtp layer"] == "model.layers.61.*" and fields["rope"].startswith("yarn")
    assert report["layout"]["index"] and report["layout"]["files"] == 163
    assert report["layout"]["quantization"] == "block FP8 e4m3 128x128"
    # 671B routed + dense weights in FP8, 685B with the MTP layer
    assert 680e9 < sum(r["parameters"] for r in by_dtype.values()) < 690e9
    assert by_dtype["F8_E4M3"]["bytes"] > 600e9
    # the latent cache: (512 + 64) x 61 layers x 2 bytes per token, against 128 heads' full K/V
    assert memory["kv_cache_bytes_per_token"] == 576 * 61 * 2 == 70_272
    assert memory["full_kv_bytes_per_token"] == 61 * 128 * (192 + 128) * 2
    assert memory["kv_cache_bytes"] == 70_272 * 8 * 8192


def test_kimi_int4_experts_count_as_int4(layouts):
    code, report = inspect_json(str(layouts["kimi-k2.5"]))
    int4 = report["tensors_by_dtype"]["INT4 (packed in I32)"]
    assert int4["tensors"] == 60 * 384 * 3 and int4["parameters"] == 8 * int4["bytes"] // 4
    assert report["layout"]["quantization"] == "INT4 pack-quantized, groups of 32"
    assert "vision_tower" in report["layout"]["groups"]      # present, and not read by a run


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp8", "tp8-ep"])
def test_kimi_with_its_int4_experts_kept_fits_eight_h200s_with_room_for_long_caches(layouts, expert_parallel):
    """Kept packed (target.quantization: auto), Kimi K2.5's experts take their words and a bf16 scale
    per 32 weights in place of bf16 weights; the rest stays bf16. Split 8 ways, a rank fits a 141 GB
    GPU with at least 64k tokens of KV cache, and not an 80 GB one."""
    args = ["--tensor-parallel", "8", *(["--expert-parallel"] if expert_parallel else [])]
    code, report = inspect_json(str(layouts["kimi-k2.5"]), *args)
    assert code == 0
    memory, int4 = report["memory"], report["tensors_by_dtype"]["INT4 (packed in I32)"]
    published = int4["bytes"] + int4["parameters"] // 32 * 2            # words, and their bf16 scales
    assert memory["int4_weights_bytes"] == memory["weights_bytes"] - 2 * int4["parameters"] + published
    assert 580e9 < memory["int4_weights_bytes"] < 610e9                 # the release's ~594 GB
    rank = memory["per_rank"]
    assert rank["int4_weights_bytes"] == rank["weights_bytes"] - (2 * int4["parameters"] - published) // 8
    h100, h200 = memory["gpus"]
    assert h200["gpu"].startswith("141 GB") and h200["fits"] and h200["kv_cache_tokens"] >= 65_536
    assert h100["gpu"].startswith("80 GB") and not h100["weights_fit"]
    assert h200["kv_cache_tokens"] == (int(0.9 * (139 << 30)) - (4 << 30) - rank["int4_weights_bytes"]) \
        // rank["kv_cache_bytes_per_token"]


def test_deepseek_v3_with_its_fp8_weights_kept_is_judged_on_the_bytes_a_rank_holds(layouts):
    """At TP 8 a rank holds an eighth of the kept FP8 weights: the GPU verdict reads that figure, not
    the bf16 one (DeepSeek-V3 in FP8 runs on 8 H200s)."""
    code, report = inspect_json(str(layouts["deepseek-v3"]), "--tensor-parallel", "8")
    memory = report["memory"]
    rank = memory["per_rank"]
    saved = memory["weights_bytes"] - memory["fp8_weights_bytes"]
    assert rank["fp8_weights_bytes"] == rank["weights_bytes"] - saved // 8
    h100, h200 = memory["gpus"]
    assert h200["fits"] and not h100["weights_fit"]
    assert h200["kv_cache_tokens"] == (int(0.9 * (139 << 30)) - (4 << 30) - rank["fp8_weights_bytes"]) \
        // rank["kv_cache_bytes_per_token"]


def test_a_full_size_deepseek_v3_is_inspected_from_its_headers_alone(layouts):
    """The folder says 680 GB; its data region is sparse and must never be read. /proc/self/io's
    rchar counts every byte read() returns to this process: the inspection reads the headers, the
    JSON files beside them, and next to nothing else (timing: see the README; a unit test does not
    time)."""
    from specgen.checkpoints import headers
    from specgen.inspection.report import inspect_checkpoint

    inspect_checkpoint(str(layouts["kimi-k2.5"]))      # imports every module the DeepSeek path needs
    headers._READ.clear()

    def read_so_far() -> int:
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])

    before = read_so_far()
    report = inspect_checkpoint(str(layouts["deepseek-v3"]))
    read = read_so_far() - before
    folder_bytes = sum(p.stat().st_size for p in layouts["deepseek-v3"].glob("*.safetensors"))
    assert report.runnable and folder_bytes > 600e9
    folder = layouts["deepseek-v3"]
    metadata = sum(p.stat().st_size for p in folder.glob("*.json"))      # config.json and the shard index
    assert read < header_bytes(folder) + metadata + (1 << 20), (read, header_bytes(folder), metadata)


def test_drafts_fit_their_targets(layouts):
    code, report = inspect_json(str(layouts["eagle3-llama3.1-8b"]), "--target", str(layouts["llama-3.1-8b"]))
    checks = {c["name"]: c for c in report["compatibility"]}
    assert code == 0 and all(c["ok"] for c in checks.values())
    assert set(checks) >= {"pairing", "vocabulary", "hidden size", "layer ids", "d2t range", "tokenizer", "weights"}
    assert "32000 draft ids" in checks["d2t range"]["detail"]
    code, report = inspect_json(str(layouts["kimi-k2.5-eagle3"]), "--target", str(layouts["kimi-k2.5"]))
    assert code == 0 and report["fields"]["attention"].startswith("MLA")


def test_the_rich_report_names_what_matters(layouts):
    result = invoke("inspect-checkpoint", str(layouts["eagle3-llama3.1-8b"]), "--target", str(layouts["llama-3.1-8b"]))
    assert result.exit_code == 0
    for words in ("eagle3 draft", "runnable", "tensors by dtype", "memory to run", "d2t range", "PASS"):
        assert words in result.output, words


# -------------------------------------------------------------------------------- broken variants


def _edited_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _reshape(name, shape):
    return lambda header: header[name].update(shape=shape)


def _reshaped(folder, shapes: dict) -> None:
    """Give tensors other shapes, each in the file that holds it."""
    for name, shape in shapes.items():
        edit_header(folder, _reshape(name, shape), name)


def _drop(name):
    return lambda header: header.pop(name)


E5 = "model.layers.3.mlp.experts.5.down_proj.weight"
K0 = "model.layers.0.self_attn.k_proj.weight"
ENORM = "model.layers.61.enorm.weight"
KIMI_PACKED = "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed"


# name -> (layout, how to break it (folder -> None), --target layout, expected message, inspect exit)
BROKEN = {
    "missing shard": ("llama-3.1-8b", break_missing_shard, None, r"model-00002-of-00004\.safetensors: missing", 2),
    "truncated file": ("llama-3.1-8b", break_truncate, None, r"truncated: its header describes", 2),
    "garbage header": ("llama-3.1-8b", break_garbage_header, None, r"corrupt header: not valid JSON", 2),
    "cut header": ("llama-3.1-8b", break_truncated_header, None, r"corrupt or truncated header", 2),
    "wrong shape": ("llama-3.1-8b", lambda f: edit_header(f, _reshape("model.embed_tokens.weight", [128256, 4000])),
                    None, r"model\.embed_tokens\.weight has shape \[128256, 4000\], the config implies \[128256, 4096\]", 1),
    "offset gap": ("llama-3.1-8b", break_offsets, None, r"corrupt header: tensor .* starts at byte", 2),
    "index without its tensor": ("llama-3.1-8b", break_index, None,
                                 r"places model\.layers\.0\.ghost\.weight in this file, but its header lacks it", 2),
    "unfusable projection": ("llama-3.1-8b", lambda f: _reshaped(f, {K0: [1024, 4000]}), None,
                             r"k_proj\.weight has shape \[1024, 4000\], which cannot be concatenated", 1),
    "missing tensor": ("deepseek-v3", lambda f: edit_header(f, _drop("model.embed_tokens.weight")), None,
                       r"missing tensor model\.embed_tokens\.weight|missing model\.embed_tokens\.weight", 1),
    "unstackable expert": ("deepseek-v3", lambda f: _reshaped(f, {E5: [7168, 1920], E5 + "_scale_inv": [56, 15]}), None,
        r"experts\.5\.down_proj\.weight has shape \[7168, 1920\], which cannot be stacked", 1),
    "mtp layer incomplete": ("deepseek-v3", lambda f: edit_header(f, _drop(ENORM), ENORM), None,
                             r"missing enorm\.weight", 1),
    "int4 packing": ("kimi-k2.5", lambda f: _reshaped(f, {KIMI_PACKED: [2048, 800]}), None,
                     r"packed shape \[2048, 800\] does not hold a 2048x6400 weight|does not match groups", 1),
    "fp8 scale shape": ("deepseek-v3", lambda f: edit_header(
        f, _reshape("model.layers.0.self_attn.q_a_proj.weight_scale_inv", [12, 55])), None, r"does not tile", 1),
    "draft for another vocabulary": ("eagle3-llama3.1-8b", lambda f: _edited_config(f, vocab_size=151936),
                                     "llama-3.1-8b", r"vocab_size 151936 differs from the target's 128256", 1),
    "layer ids past the depth": ("eagle3-llama3.1-8b", lambda f: _edited_config(
        f, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 15, 40]}), "llama-3.1-8b",
        r"aux layer ids \[1, 15, 40\] are outside the target's 32 layers", 1),
    "draft layer wrong shape": ("eagle3-llama3.1-8b", lambda f: edit_header(f, _reshape("fc.weight", [4096, 8192])),
                                "llama-3.1-8b", r"fc\.weight has shape \[4096, 8192\], the config implies \[4096, 12288\]", 1),
    "dflash for another model": ("dflash-qwen3-8b", lambda f: None, "llama-3.1-8b",
                                 r"mask_token_id 151669 is not a row of the target embedding", 1),
}


@pytest.fixture
def broken(tmp_path, layouts, request):
    name = request.param
    layout, edit, target, message, code = BROKEN[name]
    folder = write_layout(tmp_path, layout)       # a fresh copy (a sparse file must not be copied)
    edit(folder)
    return folder, layouts[target] if target else None, message, code


@pytest.mark.parametrize("broken", list(BROKEN), indirect=True)
def test_inspect_flags_each_broken_variant(broken):
    folder, target, message, code = broken
    args = [str(folder)] + (["--target", str(target)] if target else [])
    exit_code, report = inspect_json(*args)
    assert exit_code == code
    if code == 2:
        assert report["readable"] is False and str(folder) in report["error"]
        assert re.search(message, report["error"]), report["error"]
    else:
        reasons = report["problems"] + [c["detail"] for c in report["compatibility"] or [] if not c["ok"]]
        assert any(re.search(message, r) for r in reasons), reasons
    text = invoke("inspect-checkpoint", *args)
    assert text.exit_code == code
    assert_no_crash(text)


@pytest.mark.parametrize("broken", list(BROKEN), indirect=True)
def test_run_stops_on_each_broken_variant_with_exit_2(broken, tmp_path):
    """Before any weight loads: `path: problem`, exit 2, no traceback, no output written."""
    folder, target, message, _ = broken
    if target is None:
        mtp = "enorm" in message     # the MTP layer inside the target: checked when a run drafts with it
        recipe = {"target": {"model": str(folder)}, "draft": {"method": "mtp" if mtp else "none"}}
    else:
        method = json.loads((folder / "config.json").read_text())
        recipe = {"target": {"model": str(target)},
                  "draft": {"method": "dflash" if "dflash_config" in method else "eagle3", "model": str(folder)}}
    recipe.update(output=str(tmp_path / "out" / "results.jsonl"), runtime={"device": "cpu", "max_seq_len": 64})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = invoke("run", str(path), "--prompts", "default", "--limit", "1")
    assert result.exit_code == 2, result.output
    assert_no_crash(result)
    assert re.search(message, " ".join(result.output.split())), result.output
    assert folder.name in result.output          # the message names the checkpoint
    assert not (tmp_path / "out" / "results.jsonl").exists()


def test_unreadable_paths_exit_2(tmp_path):
    assert invoke("inspect-checkpoint", str(tmp_path / "nowhere")).exit_code == 2
    (tmp_path / "empty").mkdir()
    result = invoke("inspect-checkpoint", str(tmp_path / "empty"))
    assert result.exit_code == 2 and "no config.json" in result.output


# --------------------------------------------------------------------------------- tiny, real runs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    config = tiny_llama_config(vocab_size=300)
    target = write_llama_checkpoint(root / "target", config)
    draft = write_eagle3_checkpoint(root / "eagle3", tiny_eagle3_config(config), config)
    return root, target, draft


def _recipe(root, target, draft, **extra):
    recipe = {"target": {"model": str(target)}, "draft": {"method": "eagle3", "model": str(draft),
                                                           "num_speculative_tokens": 2},
              "sampling": {"max_tokens": 8}, "runtime": {"device": "cpu", "batch_size": 4, "max_seq_len": 128},
              **extra}
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_an_output_path_that_cannot_be_written_exits_2_before_loading(tiny, tmp_path):
    root, target, draft = tiny
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    recipe = _recipe(tmp_path, target, draft)
    result = invoke("run", str(recipe), "--output", str(blocker / "sub" / "out.jsonl"), "--limit", "1")
    assert result.exit_code == 2
    assert_no_crash(result)
    assert "cannot create its folder" in result.output and "a-file" in result.output
    result = invoke("run", str(recipe), "--output", str(tmp_path), "--limit", "1")
    assert result.exit_code == 2 and "is a folder" in result.output


def test_a_draft_that_never_accepts_is_reported_as_probably_mismatched(tiny, tmp_path):
    """A random (but not load_format: dummy) draft accepts next to nothing: after MISMATCH_DRAFTS
    drafts the log says the draft is probably mismatched."""
    from specgen.job.statistics import MISMATCH_DRAFTS, MISMATCH_LENGTH

    root, target, draft = tiny
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"say {i}"}) + "\n" for i in range(40)))
    recipe = _recipe(tmp_path, target, draft, sampling={"max_tokens": 24, "ignore_eos": True})
    result = invoke("run", str(recipe), "--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl"))
    assert result.exit_code == 0, result.output
    stats = json.loads((tmp_path / "o.jsonl.stats.json").read_text())
    assert stats["spec"]["num_drafts"] >= MISMATCH_DRAFTS
    assert stats["spec"]["mean_acceptance_length"] < MISMATCH_LENGTH
    assert "probably mismatched" in " ".join(result.output.split())
    assert any("probably mismatched" in n for n in stats["notes"])


def test_inspect_the_embedded_gguf_from_its_metadata(tmp_path, monkeypatch):
    """No conversion in the cache: the GGUF file's metadata, no tensor read or converted."""
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    code, report = inspect_json("smollm2-135m-instruct")
    assert code == 0 and report["format"] == "gguf" and report["architecture"] == "LlamaForCausalLM"
    assert report["fields"]["layers"] == 30 and report["fields"]["hidden size"] == 576
    assert "Q4_1" in report["tensors_by_dtype"]
    assert not (tmp_path / "cache" / "models").exists()


def test_bench_stops_on_a_broken_checkpoint_with_exit_2(tmp_path):
    folder = write_layout(tmp_path, "llama-3.1-8b")
    break_truncate(folder)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"target": {"model": str(folder)}, "draft": {"method": "none"},
                                    "runtime": {"device": "cpu"}}))
    result = invoke("bench", str(path), "--prompts", "default", "--baselines", "ar", "--output",
                    str(tmp_path / "bench.json"))
    assert result.exit_code == 2
    assert_no_crash(result)
    assert "truncated" in result.output and not (tmp_path / "bench.json").exists()


# ------------------------------------------------------------------------- the dry load == the load

TINY_BREAKS = {   # a real tiny checkpoint's tensors, edited
    "wrong shape": lambda s: s.update({"model.layers.1.mlp.down_proj.weight": s["model.layers.1.mlp.down_proj.weight"][:, :-1]}),
    "missing and unexpected": lambda s: s.update({"model.layers.2.extra.weight": s.pop("model.norm.weight")}),
    "unfusable": lambda s: s.update({"model.layers.0.self_attn.v_proj.weight": s["model.layers.0.self_attn.v_proj.weight"][:, :-1]}),
}


@pytest.mark.parametrize("name", list(TINY_BREAKS))
def test_the_dry_check_finds_exactly_what_the_real_load_finds(tmp_path, name):
    """One source of truth: on the same broken checkpoint, the header-only check and the real load
    raise the same error (LayoutError lists every problem; both paths list the same ones)."""
    import torch
    from safetensors.torch import load_file, save_file

    from specgen.checkpoints.loading import load_target
    from specgen.checkpoints.store import CheckpointError, read_config
    from specgen.models.materialise import LayoutError

    folder = write_llama_checkpoint(tmp_path / "t", tiny_llama_config())
    state = load_file(str(folder / "model.safetensors"))
    TINY_BREAKS[name](state)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    config = read_config(folder)
    errors = []
    for dry in (True, False):
        with pytest.raises(CheckpointError) as err:
            load_target(config, folder, dtype=torch.float32, device="meta" if dry else "cpu", dummy=False, dry=dry)
        errors.append(err.value)
    dry_error, real_error = errors
    assert type(dry_error) is type(real_error) and str(folder) in str(dry_error)
    if isinstance(dry_error, LayoutError):
        assert dry_error.problems == real_error.problems and dry_error.problems
    else:      # fusing tensors of the wrong width: the dry check names them, torch does not
        assert "cannot be concatenated" in str(dry_error) and "v_proj" in str(dry_error)


def test_the_mismatch_warning_needs_enough_drafts_and_a_real_draft():
    from types import SimpleNamespace

    from specgen.job.statistics import MISMATCH_DRAFTS, MismatchWatch
    from specgen.pipelines.stats import SpecCounters
    from specgen.recipe import recipe_from_dict

    def progress(drafts, accepted):
        counters = SpecCounters(2, drafts, 2 * drafts, accepted)
        return SimpleNamespace(totals=counters)

    real = recipe_from_dict({"target": {"model": "x"}, "draft": {"method": "eagle3", "model": "d"}})
    said = []
    watch = MismatchWatch(real, said.append)
    watch(progress(MISMATCH_DRAFTS - 1, 0))           # too early to tell
    assert not said
    watch(progress(MISMATCH_DRAFTS, MISMATCH_DRAFTS))  # acceptance length 2.0: a working draft
    watch(progress(2 * MISMATCH_DRAFTS, 0))            # judged once, at the first chance only
    assert not said and not watch.notes
    dummy = recipe_from_dict({"target": {"model": "x"}, "draft": {"method": "eagle3", "load_format": "dummy"}})
    quiet = MismatchWatch(dummy, said.append)
    quiet(progress(MISMATCH_DRAFTS, 0))               # random-init drafts accept nothing by design
    assert not said
    loud = MismatchWatch(real, said.append)
    loud(progress(MISMATCH_DRAFTS, 3))
    assert len(said) == 1 and "probably mismatched" in said[0] and loud.notes


def test_a_dflash_draft_alone_is_checked_against_the_depth_it_states(tmp_path, layouts):
    """Without --target, the layout is checked against the dimensions the draft's config states,
    read where its loader reads them (top-level target_layer_ids included)."""
    from header_checkpoints import layout, write_header_only

    config, tensors = layout("dflash-qwen3-8b")
    ids = config.pop("dflash_config")
    config.update(ids)                        # mask_token_id and target_layer_ids at the top level
    config.pop("num_target_layers", None)
    folder = write_header_only(tmp_path / "dflash", config, tensors)
    code, report = inspect_json(str(folder))
    assert code == 0 and report["fields"]["target layer ids"] == ids["target_layer_ids"], report["problems"]


def test_d2t_out_of_the_target_vocabulary_fails_its_check(tiny, tmp_path):
    """The one tensor inspect reads: a reduced-vocabulary EAGLE-3 draft's d2t, checked against --target."""
    from safetensors.torch import load_file, save_file

    _, target, _ = tiny
    config = tiny_llama_config(vocab_size=300)
    draft = write_eagle3_checkpoint(tmp_path / "d", tiny_eagle3_config(config, draft_vocab_size=200), config)
    code, report = inspect_json(str(draft), "--target", str(target))
    assert code == 0 and next(c for c in report["compatibility"] if c["name"] == "d2t range")["ok"]
    state = load_file(str(draft / "model.safetensors"))
    state["d2t"] = state["d2t"] + 300
    save_file(state, str(draft / "model.safetensors"))
    code, report = inspect_json(str(draft), "--target", str(target))
    check = next(c for c in report["compatibility"] if c["name"] == "d2t range")
    assert code == 1 and not check["ok"] and "outside the target vocabulary 0..299" in check["detail"]


def test_a_target_given_as_the_draft_is_refused(layouts):
    code, report = inspect_json(str(layouts["llama-3.1-8b"]), "--target", str(layouts["llama-3.1-8b"]))
    assert code == 1 and "is itself a target, not a draft" in report["problems"][0]
