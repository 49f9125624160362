"""Every Triton kernel specgen launches, compiled for A100 (sm_80) and H100 (sm_90) on this CPU machine.

kernels/launch_configs.py is the one table the launch code reads; kernels/offline_compile.py walks it
(`launch_cases`: each entry at each element type and real head width) and compiles each case with
Triton's own ptxas, no GPU needed. A case that asks for more shared memory than the device gives one
block, spills registers or uses more than MAX_REGISTERS fails here, before any GPU runs it.

The compile runs in a process of its own: the suite sets TRITON_INTERPRET=1, under which `triton.jit`
makes interpreter functions that cannot be compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from specgen.kernels import launch_configs, offline_compile


@pytest.fixture(scope="module")
def footprints():
    if not offline_compile.available():
        pytest.skip("Triton's CUDA backend (ptxas, cuobjdump) is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-m", "specgen.kernels.offline_compile", "--json"],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_launch_fits_an_a100_and_an_h100(footprints):
    for r in footprints:       # the table, in the test's output (pytest -rA shows it)
        print(f"{r['launch']:<44} sm_{r['arch']}  shared {r['shared_bytes']:>6} B of {r['limit_bytes']}  "
              f"{r['registers']:>3} registers  stack {r['stack_bytes']} B")
    over = [f"{r['launch']} on sm_{r['arch']}: {'; '.join(r['over'])}" for r in footprints if r["over"]]
    assert not over, "launch configurations that do not fit:\n" + "\n".join(over)


def test_the_walk_covers_every_entry_of_the_table_on_both_architectures(footprints):
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for arch in offline_compile.ARCHS:
        names = [r["launch"].split() for r in footprints if r["arch"] == arch]
        attention_entries = {launch_configs.attention(dtypes[n[1]], int(n[3]))
                             for n in names if n[0] == "attention"}
        latent_entries = {launch_configs.latent_attention(dtypes[n[2]], 512, 64) for n in names if n[0] == "latent"}
        assert attention_entries == set(launch_configs.ATTENTION.values())
        assert latent_entries == set(launch_configs.LATENT_ATTENTION.values())
        assert {"merge", "verify"} <= {n[0] for n in names}
    assert {r["launch"] for r in footprints if r["arch"] == 90} >= {"block-FP8 GEMM -> bf16", "block-FP8 pairs -> bf16"}


@pytest.mark.parametrize("head_dim", [16, 24, 48, 64, 80, 96, 128, 160, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_head_width_a_model_can_have_takes_an_entry_of_the_table(dtype, head_dim):
    assert launch_configs.attention(dtype, head_dim) in launch_configs.ATTENTION.values()


def test_wider_heads_than_the_table_holds_are_refused_not_guessed():
    with pytest.raises(ValueError, match="head dims up to 256"):
        launch_configs.attention(torch.bfloat16, 576)
    with pytest.raises(ValueError, match="checked up to 512 \\+ 64"):
        launch_configs.latent_attention(torch.bfloat16, 1024, 64)
    assert launch_configs.latent_attention(torch.float32, 512, 64) is launch_configs.LATENT_ATTENTION[4]
