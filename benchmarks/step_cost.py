"""Cost of one speculative step relative to one plain decode step, per draft method and K.

One step drafts k tokens per slot and verifies k + 1. This script times steps of each shipped draft
(the recipes' own checkpoints) at every K asked, and of plain decoding (`draft.method: none`), on the
same target, prompts and batch size, in one process, and prints the ratio: the acceptance length a
draft needs to break even at that K. Every K of a draft runs on one compiled step (verify is one
graph for every number of rows; each draft variant is compiled once), as `num_speculative_tokens:
auto` runs it. `--dummy` swaps in random-init drafts of the published layouts instead (EAGLE-3's
then has the target's whole vocabulary as its head, where the shipped draft has 8,192 rows).

    python benchmarks/step_cost.py --batch-sizes 1 8 --ks 1 2 3 [--compile] [--dummy]
"""

from __future__ import annotations

import argparse
import time

from specgen.job import build_runner, resolve
from specgen.pipelines.policy import FixedPolicy
from specgen.pipelines.runner import Request
from specgen.recipe import load_recipe

RECIPES = {"none": "recipes/smollm2-ar.yaml", "eagle3": "recipes/smollm2-eagle3.yaml",
           "dflash": "recipes/smollm2-dflash.yaml", "mtp": "recipes/smollm2-mtp.yaml"}


def ms_per_step(method: str, ks: list[int], batch: int, steps: int, compile: bool, dummy: bool,
                dtype: str = "auto") -> dict[int, float]:
    """{k: wall ms per step} for a runner of `method` (k = 0 only for `none`)."""
    overrides = [f"runtime.batch_size={batch}", "sampling.ignore_eos=true", "train=null",
                 f"runtime.compile={str(compile).lower()}", f"target.dtype={dtype}"]
    if method != "none":
        overrides += ["draft.num_speculative_tokens=auto", f"draft.max_speculative_tokens={max(ks)}"]
        if dummy:
            overrides += ["draft.load_format=dummy", "draft.model=null"]
    recipe = load_recipe(RECIPES[method], overrides)
    runner, tokenizer, _ = build_runner(recipe, resolve(recipe), 0)
    prompts = [tokenizer.encode(f"Tell me a story about the number {i}.") for i in range(batch)]

    def go(tag: str, n: int) -> float:
        requests = [Request(f"{tag}{i}", p, n, i) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        totals = runner.run(requests, lambda c: None)
        return (time.perf_counter() - start) / totals.steps

    out = {}
    for k in ([0] if method == "none" else ks):
        runner.use_policy(FixedPolicy(k))
        go(f"warm{k}-", steps)  # same lengths as the timed run: every compiled variant is built here
        out[k] = go(f"timed{k}-", steps) * 1000
    runner.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--methods", nargs="+", default=["eagle3", "dflash", "mtp"])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--dtype", default="auto", help="target.dtype (auto: the recipe's choice)")
    parser.add_argument("--dummy", action="store_true", help="random-init drafts instead of the shipped ones")
    args = parser.parse_args()
    for batch in args.batch_sizes:
        base = ms_per_step("none", [0], batch, args.steps, args.compile, args.dummy, args.dtype)[0]
        print(f"batch {batch}: none {base:.1f} ms", flush=True)
        for method in args.methods:
            times = ms_per_step(method, args.ks, batch, args.steps, args.compile, args.dummy, args.dtype)
            row = ", ".join(f"K={k} {t:.1f} ms ({t / base:.2f}x)" for k, t in times.items())
            print(f"batch {batch}: {method} {row}", flush=True)


if __name__ == "__main__":
    main()
