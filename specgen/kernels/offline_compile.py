"""Compile a Triton kernel for a GPU this machine does not have, and read what it asks of the GPU.

Contract. `compile_for(kernel, signature, constexprs, arch, num_warps, num_stages)` runs Triton's whole
CUDA pipeline (TTIR -> TTGIR -> LLVM -> PTX -> ptxas -> cubin) for compute capability `arch` (80 =
A100, 90 = H100) with the ptxas shipped in Triton's wheel, and returns a `Footprint`: the dynamic
shared memory one program asks for (Triton's `metadata.shared`, which the launch must fit under the
device's per-block limit), registers per thread and the stack frame per thread (`cuobjdump
--dump-resource-usage`). Triton inlines every device function, so a stack frame means registers
spilled to local memory: each spill is a round trip to L1/L2 inside the kernel's loops.

No GPU and no CUDA driver are needed (tests/test_gpu_compile.py runs it in `make test` on CPU);
`available()` says whether this Triton has the CUDA backend and its tools.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from .keyed_noise import triton

# The most dynamic shared memory one block may ask for (the opt-in maximum), in bytes: A100 (sm_80)
# 163 KiB, H100 (sm_90) 227 KiB (CUDA C Programming Guide, "Technical Specifications per Compute
# Capability"). Launch configurations are checked against the device they would run on.
SHARED_MEMORY_PER_BLOCK = {80: 163 * 1024, 90: 227 * 1024}
ARCHS = tuple(SHARED_MEMORY_PER_BLOCK)


@dataclass(frozen=True)
class Footprint:
    shared_bytes: int      # dynamic shared memory per program
    registers: int         # per thread
    stack_bytes: int       # per thread: spilled registers


def available() -> bool:
    """Whether kernels can be compiled for CUDA here (Triton with its NVIDIA backend and ptxas)."""
    if triton is None:
        return False
    try:
        return os.path.exists(_cuobjdump())
    except Exception:   # noqa: BLE001 - any failure means "not here"
        return False


def _cuobjdump() -> str:
    # cuobjdump ships beside ptxas in Triton's NVIDIA backend; older Triton releases take no arch
    from triton.backends.nvidia.compiler import get_ptxas
    try:
        ptxas = get_ptxas(90).path
    except TypeError:
        ptxas = get_ptxas().path
    return os.path.join(os.path.dirname(ptxas), "cuobjdump")


def compile_for(kernel, signature: dict[str, str], constexprs: dict[str, object], arch: int,
                num_warps: int = 4, num_stages: int = 3) -> Footprint:
    """Compile `kernel` (a `triton.jit` function) for compute capability `arch`; its footprint.
    `signature` names every argument's type ("*bf16", "i32", "fp32", ... and "constexpr" for the
    names in `constexprs`)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, without its warning
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    registers, stack = _resource_usage(compiled.asm["cubin"])
    return Footprint(int(compiled.metadata.shared), registers, stack)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    # cuobjdump prints, per function: "REG:32 STACK:8304 SHARED:1024 LOCAL:0 ..."
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", out)
    if match is None:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{out}")
    return int(match.group(1)), int(match.group(2))


# ---------------------------------------------------------------------------------------------------
# Every launch specgen makes, as the table in kernels/launch_configs.py gives it
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchCase:
    name: str              # e.g. "attention bf16 head_dim 128"
    kernel: object         # the `triton.jit` function
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int
    archs: tuple[int, ...] = ARCHS





def _ints(names: str) -> dict[str, str]:
    return {n: "i32" for n in names.split()}


def _constexprs(names) -> dict[str, str]:
    return {n: "constexpr" for n in names}


def launch_cases() -> list[LaunchCase]:
    """One case per configuration the launch code can choose: every entry of launch_configs.py, at every
    element type it serves and the head widths real checkpoints have (64: SmolLM2, Llama-3.2-1B; 128:
    Llama-3 8B/70B, DFlash drafts; 192: DeepSeek-V3's q/k heads; MLA's 512 + 64 latent entries)."""
    from . import attention, block_fp8, int4_experts, latent_attention, launch_configs, rejection
    from .keyed_noise import STREAM_SALT, ACCEPT, RESIDUAL, TARGET
    attention.jit_kernels()
    latent_attention.jit_kernels()
    rejection.jit_kernels()
    block_fp8.jit_kernels()
    int4_experts.jit_kernels()
    cases = []
    widths = {64: (64,), 128: (128,), 256: (192, 256)}
    for (size, padded), launch in sorted(launch_configs.ATTENTION.items()):
        for dtype in (("bf16", "fp16") if size == 2 else ("fp32",)):
            for head_dim in widths[padded]:
                p = "*" + dtype
                signature = {"q_ptr": p, "k_ptr": p, "v_ptr": p, "rows_ptr": "*i64", "pos_ptr": "*i64",
                             "o_ptr": "*fp32", "lse_ptr": "*fp32",
                             **_ints("sq_b sq_t sq_h sk_s sk_h sk_l so_b so_t so_h so_s T D"),
                             "scale": "fp32", "chunk": "i32",
                             **_constexprs(["GROUP", "KV_HEADS", "BLOCK_D", "IEEE", *launch.tiles])}
                constexprs = {"GROUP": 4, "KV_HEADS": 8, "BLOCK_D": launch_configs.padded_head_dim(head_dim),
                              "IEEE": dtype == "fp32", **launch.tiles}
                cases.append(LaunchCase(f"attention {dtype} head_dim {head_dim}", attention._attention_kernel,
                                        signature, constexprs, launch.num_warps, launch.num_stages))
    latent, rope = launch_configs.LATENT_WIDTHS
    for size, launch in sorted(launch_configs.LATENT_ATTENTION.items()):
        for dtype in (("bf16", "fp16") if size == 2 else ("fp32",)):
            p = "*" + dtype
            signature = {"q_ptr": p, "c_ptr": p, "rows_ptr": "*i64", "pos_ptr": "*i64", "o_ptr": "*fp32",
                         "lse_ptr": "*fp32", **_ints("sq_b sq_t sq_h sc_s sc_l so_b so_t so_h so_s T R P"),
                         "scale": "fp32", "chunk": "i32",
                         **_constexprs(["HEADS", "BLOCK_R", "BLOCK_P", "IEEE", *launch.tiles])}
            constexprs = {"HEADS": 16, "BLOCK_R": latent, "BLOCK_P": rope, "IEEE": dtype == "fp32", **launch.tiles}
            cases.append(LaunchCase(f"latent attention {dtype} {latent} + {rope}",
                                    latent_attention._latent_attention_kernel, signature, constexprs,
                                    launch.num_warps, launch.num_stages))
    merge = launch_configs.MERGE
    for dtype in ("bf16", "fp32"):
        for width in (64, 128, 256, latent):
            signature = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*" + dtype, "SPLITS": "i32",
                         "D": "i32", **_constexprs(["BLOCK_S", "BLOCK_D"])}
            constexprs = {"BLOCK_S": attention.MAX_SPLITS, "BLOCK_D": width}
            cases.append(LaunchCase(f"merge {dtype} width {width}", attention._merge_kernel, signature,
                                    constexprs, merge.num_warps, merge.num_stages))
    verify = launch_configs.VERIFY
    for draft_probs in (False, True):
        for relaxed in (False, True):
            signature = {"logprobs_ptr": "*fp32", "draft_tokens_ptr": "*i64", "draft_probs_ptr": "*fp32",
                         "greedy_ptr": "*i1", "noise_key_ptr": "*i64", "positions_ptr": "*i64",
                         "relaxed_ptr": "*i1", "accepted_ptr": "*i64", "emitted_ptr": "*i64",
                         "relaxed_accepted_ptr": "*i64", "K": "i32", "V": "i32",
                         **_constexprs(["SALT_TARGET", "SALT_ACCEPT", "SALT_RESIDUAL", "HAS_DRAFT_PROBS",
                                        "HAS_RELAXED", "BLOCK_K", *verify.tiles])}
            constexprs = {"SALT_TARGET": STREAM_SALT[TARGET], "SALT_ACCEPT": STREAM_SALT[ACCEPT],
                          "SALT_RESIDUAL": STREAM_SALT[RESIDUAL], "HAS_DRAFT_PROBS": draft_probs,
                          "HAS_RELAXED": relaxed, "BLOCK_K": 16, **verify.tiles}
            cases.append(LaunchCase(f"verify draft_probs={draft_probs} relaxed={relaxed}",
                                    rejection._verify_kernel, signature, constexprs, verify.num_warps,
                                    verify.num_stages))
    # FP8 tensor cores: compute capability 8.9+ (an A100 dequantises FP8 weights on load instead)
    gemm = launch_configs.BLOCK_FP8_GEMM
    for out in ("bf16", "fp32"):
        signature = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32",
                     "out_ptr": "*" + out, **_ints("M N K KB stride_xm stride_wn stride_om"),
                     **_constexprs(["BLOCK_K", *gemm.tiles])}
        cases.append(LaunchCase(f"block-FP8 GEMM -> {out}", block_fp8._block_fp8_gemm_kernel, signature,
                                {"BLOCK_K": block_fp8.BLOCK, **gemm.tiles}, gemm.num_warps, gemm.num_stages,
                                archs=(90,)))
        pairs = launch_configs.BLOCK_FP8_PAIRS
        signature = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "e_ptr": "*i64", "w_ptr": "*fp8e4nv",
                     "ws_ptr": "*fp32", "out_ptr": "*" + out,
                     **_ints("N K KB NB stride_xm stride_we stride_wn stride_om"),
                     **_constexprs(["BLOCK_K", *pairs.tiles])}
        cases.append(LaunchCase(f"block-FP8 pairs -> {out}", block_fp8._block_fp8_pairs_kernel, signature,
                                {"BLOCK_K": block_fp8.BLOCK, **pairs.tiles}, pairs.num_warps, pairs.num_stages,
                                archs=(90,)))
        grouped = launch_configs.BLOCK_FP8_GROUPED
        signature = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "rows_ptr": "*i64", "block_expert_ptr": "*i64",
                     "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*" + out,
                     **_ints("N K KB NB stride_xm stride_we stride_wn stride_om"),
                     **_constexprs(["BLOCK_K", *grouped.tiles])}
        cases.append(LaunchCase(f"block-FP8 grouped -> {out}", block_fp8._block_fp8_grouped_kernel, signature,
                                {"BLOCK_K": block_fp8.BLOCK, **grouped.tiles}, grouped.num_warps,
                                grouped.num_stages, archs=(90,)))
    int4 = launch_configs.INT4_GROUPED
    for out in ("bf16", "fp32"):
        signature = {"x_ptr": "*bf16", "rows_ptr": "*i64", "block_expert_ptr": "*i64", "w_ptr": "*i32",
                     "s_ptr": "*bf16", "out_ptr": "*" + out,
                     **_ints("N K KG stride_xm stride_we stride_wn stride_se stride_sn stride_om"),
                     **_constexprs(["GROUP", "FLOAT32_DOT", *int4.tiles])}
        cases.append(LaunchCase(f"INT4 experts grouped -> {out}", int4_experts._int4_grouped_kernel, signature,
                                {"GROUP": 32, "FLOAT32_DOT": False, **int4.tiles}, int4.num_warps, int4.num_stages))
    return cases


def compile_case(case: LaunchCase, arch: int) -> Footprint:
    return compile_for(case.kernel, case.signature, case.constexprs, arch, case.num_warps, case.num_stages)


def footprints() -> list[dict]:
    """Every launch compiled for each of its architectures, with its limits (for the test and `main`)."""
    from . import launch_configs
    rows = []
    for case in launch_cases():
        for arch in case.archs:
            f = compile_case(case, arch)
            over = []
            if f.shared_bytes > SHARED_MEMORY_PER_BLOCK[arch]:
                over.append(f"shared memory {f.shared_bytes} B > {SHARED_MEMORY_PER_BLOCK[arch]} B")
            if f.stack_bytes > launch_configs.MAX_STACK_BYTES:
                over.append(f"stack (spills) {f.stack_bytes} B > {launch_configs.MAX_STACK_BYTES} B")
            if f.registers > launch_configs.MAX_REGISTERS:
                over.append(f"registers {f.registers} > {launch_configs.MAX_REGISTERS}")
            rows.append({"launch": case.name, "arch": arch, "shared_bytes": f.shared_bytes,
                         "limit_bytes": SHARED_MEMORY_PER_BLOCK[arch], "registers": f.registers,
                         "stack_bytes": f.stack_bytes, "num_warps": case.num_warps,
                         "num_stages": case.num_stages, "over": over})
    return rows


def main() -> None:
    """`python -m specgen.kernels.offline_compile [--json]`: every launch, compiled for each architecture;
    exit 1 if one does not fit."""
    import json
    import sys
    if not available():
        print("Triton's CUDA backend (ptxas, cuobjdump) is not installed here: nothing compiled")
        raise SystemExit(2)
    rows = footprints()
    if "--json" in sys.argv[1:]:
        print(json.dumps(rows))
    else:
        print(f"{'launch':<44} {'arch':>5} {'warps':>5} {'shared B':>9} {'limit B':>8} {'regs':>5} {'stack B':>8}")
        for r in rows:
            print(f"{r['launch']:<44} {'sm_' + str(r['arch']):>5} {r['num_warps']:>5} {r['shared_bytes']:>9} "
                  f"{r['limit_bytes']:>8} {r['registers']:>5} {r['stack_bytes']:>8}"
                  + (f"  OVER: {'; '.join(r['over'])}" if r["over"] else ""))
    raise SystemExit(1 if any(r["over"] for r in rows) else 0)


if __name__ == "__main__":
    main()
