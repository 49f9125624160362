"""Job-level decisions made before any model loads: whether compiling pays, and the memory estimate."""

from __future__ import annotations

import pytest
import torch

from specgen.job.build import CPU_COMPILE_MIN_STEPS, decide_compile
from specgen.recipe import recipe_from_dict

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def recipe(compile=None):
    return recipe_from_dict({"target": {"model": "m"}, "runtime": {"compile": compile}})



def pretend_cpu(monkeypatch, *, bf16: bool, avx512: bool, amx: bool | None = None) -> None:
    """The CPU features the dtype choices (job/resolved.py) and the run's header (job/build.py) read."""
    import specgen.job.build as build
    import specgen.job.resolved as resolved

    for module in (resolved, build):
        monkeypatch.setattr(module, "cpu_has_bf16", lambda: bf16)
        monkeypatch.setattr(module, "cpu_has_avx512", lambda: avx512)
        if amx is not None:
            monkeypatch.setattr(module, "cpu_has_amx", lambda: amx)

def test_auto_compiles_on_cuda_and_only_long_jobs_on_cpu():
    assert decide_compile(recipe(), CUDA, 10, slots=8)[0] is True
    short, why = decide_compile(recipe(), CPU, 100, slots=16)
    assert short is False and "about 100 steps, too few" in why and "runtime.compile: true" in why
    # many slots (above CPU_FREEZE_MAX_SLOTS): not frozen, which compiles faster
    assert decide_compile(recipe(), CPU, CPU_COMPILE_MIN_STEPS["not frozen"], slots=128)[0] is True
    # few slots: weights are frozen, which compiles longer, so the job must be longer
    assert decide_compile(recipe(), CPU, CPU_COMPILE_MIN_STEPS["not frozen"], slots=4)[0] is False
    assert decide_compile(recipe(), CPU, CPU_COMPILE_MIN_STEPS["frozen"], slots=4)[0] is True
    assert decide_compile(recipe(), CPU, None, slots=4) == (False, "auto: job size unknown")


def test_an_explicit_setting_always_wins():
    assert decide_compile(recipe(True), CPU, 1, slots=1) == (True, "runtime.compile")
    assert decide_compile(recipe(False), CUDA, 10**6, slots=64) == (False, "runtime.compile")


def test_memory_estimate_counts_weights_caches_and_transients():
    from checkpoints import reference_config

    from specgen.job import Resolved, estimate_bytes

    config = reference_config("meta-llama__Llama-3.1-8B-Instruct.config.json")
    plan = recipe_from_dict({"target": {"model": "m"},
                             "runtime": {"batch_size": 64, "max_seq_len": 2048},
                             "sampling": {"temperature": 0.8, "top_p": 0.9}})
    for device, graphs in ((CPU, False), (CUDA, True)):
        parts = estimate_bytes(plan, Resolved(device, torch.bfloat16, None, config, None, None, torch.bfloat16))
        assert abs(parts["target weights"] / 2 - 8.03e9) < 0.01e9            # bf16
        assert parts["target KV cache"] == 2 * 32 * 8 * 128 * 2 * 64 * (2048 + 2)
        assert parts["logits workspace"] == 64 * 128256 * 4 * 7               # sampled with top-p
        assert {"attention workspace", "activations", "prefill workspace"} <= parts.keys()
        assert ("CUDA graph pool" in parts) is graphs


@pytest.mark.parametrize(("native", "avx512", "amx", "pays"), [(True, True, False, True), (False, True, False, True),
                                                               (False, False, False, False), (True, True, True, False)])
def test_the_draft_and_target_run_in_bf16_where_a_bf16_kernel_pays(monkeypatch, native, avx512, amx, pays):
    """`pays`: compiled steps in bf16. Not on AMX CPUs, where Inductor's AMX kernel would multiply
    (exact output first: docs/exactness.md); their eager steps keep bf16."""
    import specgen.job as job

    fp32, bf16, cpu = torch.float32, torch.bfloat16, torch.device("cpu")
    pretend_cpu(monkeypatch, bf16=native, avx512=avx512, amx=amx)
    assert job.auto_dtype(cpu) == ("bfloat16" if pays else "float32")
    # eager steps (runtime.compile off or too short a job) take bf16 only where it is native
    assert job.auto_dtype(cpu, compiled=False) == ("bfloat16" if native else "float32")
    assert job.draft_dtype("auto", fp32, cpu, compiled=False) == (bf16 if native else fp32)
    # auto: bf16 where bf16 GEMMs pay (whatever the target's dtype), else the target's
    assert job.draft_dtype("auto", fp32, cpu) == (bf16 if pays else fp32)
    assert job.draft_dtype("auto", bf16, cpu) == bf16
    # a dtype set is kept either way
    assert job.draft_dtype("bfloat16", fp32, cpu) == bf16 and job.draft_dtype("float32", bf16, cpu) == fp32


def test_an_eager_run_takes_the_eager_dtypes_on_a_cpu_that_converts_bf16(monkeypatch, tmp_path):
    """`resolve` chooses the auto dtypes for compiled steps (bf16 on any AVX-512 CPU); a run that
    will not compile, on a CPU without native bf16, loads float32 target and draft instead, says so
    in its header and reports it (`runner.resolved`). Pinned dtypes stay as set."""
    import specgen.job as job
    from checkpoints import tiny_eagle3_config, tiny_llama_config, write_eagle3_checkpoint, \
        write_llama_checkpoint

    pretend_cpu(monkeypatch, bf16=False, avx512=True)
    config = tiny_llama_config()
    target = write_llama_checkpoint(tmp_path / "target", config)
    draft = write_eagle3_checkpoint(tmp_path / "eagle3", tiny_eagle3_config(config), config)

    def runner_for(target_dtype: str, draft_dtype: str):
        recipe = recipe_from_dict({
            "target": {"model": str(target), "dtype": target_dtype},
            "draft": {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 1, "dtype": draft_dtype},
            "runtime": {"device": "cpu", "batch_size": 1, "max_seq_len": 64, "compile": False},
            "chat_template": False})
        resolved = job.resolve(recipe)
        assert resolved.dtype == torch.bfloat16 or target_dtype != "auto"    # chosen for compiled steps
        return job.build_runner(recipe, resolved, 0)[0]

    eager = runner_for("auto", "auto")
    assert (eager.resolved.dtype, eager.resolved.draft_dtype) == (torch.float32, torch.float32)
    assert "float32 (auto: eager steps" in eager.header
    assert next(eager.unified.target.parameters()).dtype == torch.float32
    pinned = runner_for("bfloat16", "auto")
    assert (pinned.resolved.dtype, pinned.resolved.draft_dtype) == (torch.bfloat16, torch.bfloat16)
