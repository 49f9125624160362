"""Cost of one speculative step relative to one plain decode step, per draft method and K.

One step drafts k tokens per slot and verifies k + 1. This script times steps of each shipped draft
(the recipes' own checkpoints) at every K asked, and of plain decoding (`draft.method: none`), on the
same target, prompts and batch size, in one process, and prints the ratio: the acceptance length a
draft needs to break even at that K, and the median time of the step's call (compiled: one call,
the draft and the verify of k + 1 rows; meaningful on CPU, where a call returns when its work is
done; on CUDA it returns once the work is queued), the rest of a step being the host's. Every K of
a draft runs on one runner, each variant compiled once, as `num_speculative_tokens: auto` runs it.
`--dummy` swaps in random-init drafts of the published layouts instead (EAGLE-3's then has the
target's whole vocabulary as its head, where the shipped draft has 8,192 rows).

    python benchmarks/step_cost.py --batch-sizes 1 8 --ks 1 2 3 [--compile] [--dummy]
        [--dtype float32] [--draft-dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from specgen.job import build_runner, resolve
from specgen.pipelines.policy import FixedPolicy
from specgen.pipelines.runner import Request
from specgen.recipe import load_recipe

RECIPES = {"none": "recipes/smollm2-ar.yaml", "eagle3": "recipes/smollm2-eagle3.yaml",
           "dflash": "recipes/smollm2-dflash.yaml", "mtp": "recipes/smollm2-mtp.yaml"}


def ms_per_step(method: str, ks: list[int], batch: int, steps: int, compile: bool, dummy: bool,
                dtype: str = "auto", draft_dtype: str = "auto") -> dict[int, tuple[float, float, float]]:
    """{k: (wall ms per step, median ms of its step's call)} for a runner of `method` (k = 0 only
    for `none`)."""
    overrides = [f"runtime.batch_size={batch}", "sampling.ignore_eos=true", "train=null",
                 f"runtime.compile={str(compile).lower()}", f"target.dtype={dtype}"]
    if method != "none":
        overrides += ["draft.num_speculative_tokens=auto", f"draft.max_speculative_tokens={max(*ks, 1)}",
                      f"draft.dtype={draft_dtype}"]
        if dummy:
            overrides += ["draft.load_format=dummy", "draft.model=null"]
    recipe = load_recipe(RECIPES[method], overrides)
    runner, tokenizer, _ = build_runner(recipe, resolve(recipe), 0)
    prompts = [tokenizer.encode(f"Tell me a story about the number {i}.") for i in range(batch)]
    calls = _time_calls(runner.functions)

    def go(tag: str, n: int) -> float:
        requests = [Request(f"{tag}{i}", p, n, i) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        totals = runner.run(requests, lambda c: None)
        return (time.perf_counter() - start) / totals.steps

    out = {}
    for k in ([0] if method == "none" else ks):
        runner.use_policy(FixedPolicy(k))
        go(f"warm{k}-", steps)  # same lengths as the timed run: every compiled variant is built here
        calls.clear()
        step = go(f"timed{k}-", steps)
        out[k] = (step * 1000, _median_ms(calls[k]))
    runner.close()
    return out


def _time_calls(functions) -> dict[int, list[float]]:
    """Record the wall time of every step call of `functions` (a StepFunctions), by k: the plain
    step's verify (k = 0) and each variant's step."""
    calls: dict[int, list[float]] = defaultdict(list)
    plain, step = functions.verify, functions.step

    def timed_plain(kv_len, t):
        start = time.perf_counter()
        out = plain(kv_len, t)
        if t == 1:
            calls[0].append(time.perf_counter() - start)
        return out

    def timed_step(kv_len, window, k, **options):
        start = time.perf_counter()
        out = step(kv_len, window, k, **options)
        calls[k].append(time.perf_counter() - start)
        return out

    functions.verify, functions.step = timed_plain, timed_step
    return calls


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000 if seconds else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--methods", nargs="+", default=["eagle3", "dflash", "mtp"])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--dtype", default="auto", help="target.dtype (auto: the recipe's choice)")
    parser.add_argument("--draft-dtype", default="auto", help="draft.dtype (auto: bf16 where native)")
    parser.add_argument("--dummy", action="store_true", help="random-init drafts instead of the shipped ones")
    args = parser.parse_args()
    for batch in args.batch_sizes:
        base, call = ms_per_step("none", [0], batch, args.steps, args.compile, args.dummy, args.dtype)[0]
        print(f"batch {batch}: none {base:.1f} ms (call {call:.1f})", flush=True)
        for method in args.methods:
            times = ms_per_step(method, args.ks, batch, args.steps, args.compile, args.dummy, args.dtype,
                                args.draft_dtype)
            row = ", ".join(f"K={k} {t:.1f} ms ({t / base:.2f}x; call {c:.1f})" for k, (t, c) in times.items())
            print(f"batch {batch}: {method} {row}", flush=True)


if __name__ == "__main__":
    main()
