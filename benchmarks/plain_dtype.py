"""Plain decoding's steady speed in one target dtype at one batch size (compiled, one process).

Which dtype pays depends on the CPU and the batch: run one process per dtype, alternating, since
this VM's pace moves between processes minutes apart.

    python benchmarks/plain_dtype.py bfloat16 8   # then float32 8, bfloat16 8, float32 8

Each process compiles the plain step, then runs the same `batch` prompts (96 tokens each, EOS
ignored) five times; it prints every job's tok/s and the median of the last four (compile time
left out).
"""

from __future__ import annotations

import argparse
import statistics
import time

from specgen.job import build_runner, resolve
from specgen.pipelines.requests import Request
from specgen.recipe import load_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtype", choices=["float32", "bfloat16"])
    parser.add_argument("batch", type=int)
    args = parser.parse_args()
    overrides = [f"runtime.batch_size={args.batch}", "sampling.ignore_eos=true", "train=null",
                 "runtime.compile=true", f"target.dtype={args.dtype}"]
    recipe = load_recipe("recipes/smollm2-ar.yaml", overrides)
    runner, tokenizer, _ = build_runner(recipe, resolve(recipe), 0)
    start = time.perf_counter()
    runner.warm_up()
    warm_up = time.perf_counter() - start
    prompts = [tokenizer.encode(f"Tell me a story about the number {i}.") for i in range(args.batch)]
    speeds = []
    for job in range(5):
        start = time.perf_counter()
        totals = runner.run([Request(f"j{job}-{i}", p, 96, i) for i, p in enumerate(prompts)], lambda c: None)
        speeds.append(totals.output_tokens / (time.perf_counter() - start - totals.compile_seconds))
    runner.close()
    print(f"{args.dtype} batch {args.batch}: warm-up {warm_up:.1f} s, tok/s {[round(s, 1) for s in speeds]}, "
          f"median of the last four {statistics.median(speeds[1:]):.1f}")


if __name__ == "__main__":
    main()
