"""Cost of one speculative step relative to one plain decode step, per draft method.

One step verifies K+1 tokens per slot and drafts the next K. This script times steps of each method
and of plain decoding (`draft.method: none`) on the same target, prompts and batch size, in one process,
and prints the ratio: the acceptance length a draft needs to break even. Drafts are random-init
(`load_format: dummy`), which changes nothing in the cost of a step.

    python benchmarks/step_cost.py --batch-sizes 1 8 [--compile]
"""

from __future__ import annotations

import argparse
import time

from specgen.job import build_runner, resolve
from specgen.pipelines.runner import Request
from specgen.recipe import load_recipe

METHODS = {"none": [], "eagle3": ["draft.num_speculative_tokens=3"],
           "dflash": ["draft.num_speculative_tokens=7"], "mtp": ["draft.num_speculative_tokens=3"]}


def ms_per_step(recipe_path: str, method: str, batch: int, steps: int, compile: bool) -> float:
    overrides = [f"draft.method={method}", "draft.load_format=dummy", "draft.model=null", "train=null",
                 f"runtime.batch_size={batch}", "sampling.ignore_eos=true",
                 f"runtime.compile={str(compile).lower()}", *METHODS[method]]
    recipe = load_recipe(recipe_path, overrides)
    runner, tokenizer, _ = build_runner(recipe, resolve(recipe), 0)
    prompts = [tokenizer.encode(f"Tell me a story about the number {i}.") for i in range(batch)]

    def go(tag: str, n: int) -> float:
        requests = [Request(f"{tag}{i}", p, n, i) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        totals = runner.run(requests, lambda c: None)
        return (time.perf_counter() - start) / totals.steps

    go("warm", steps)  # same lengths as the timed run: every compiled variant is built here
    timed = go("timed", steps) * 1000
    runner.close()
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-eagle3.yaml")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    for batch in args.batch_sizes:
        times = {m: ms_per_step(args.recipe, m, batch, args.steps, args.compile) for m in METHODS}
        base = times["none"]
        row = ", ".join(f"{m} {t:.1f} ms ({t / base:.2f}x)" for m, t in times.items())
        print(f"batch {batch}: {row}", flush=True)


if __name__ == "__main__":
    main()
