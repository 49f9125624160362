"""Cost of one speculative step relative to one plain decode step, per draft method and K.

One step drafts k tokens per slot and verifies k + 1. This script times steps of each shipped draft
(the recipes' own checkpoints) at every K asked, and of plain decoding (`draft.method: none`), on the
same target, prompts and batch size, in one process, and prints the ratio: the acceptance length a
draft needs to break even at that K, and the median time of the step's two compiled calls, the
target's verify and the draft (meaningful on CPU, where a call returns when its work is done; on
CUDA it returns once the work is queued). Every K of a draft runs on one compiled step (verify is
one graph for every number of rows; each draft variant is compiled once), as
`num_speculative_tokens: auto` runs it. `--dummy` swaps in random-init drafts of the published
layouts instead (EAGLE-3's then has the target's whole vocabulary as its head, where the shipped
draft has 8,192 rows).

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
    """{k: (wall ms per step, median ms of its verify call, of its draft call)} for a runner of
    `method` (k = 0 only for `none`)."""
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
        out[k] = (step * 1000, _median_ms(calls[("verify", k + 1)]), _median_ms(calls[("draft", k)]))
    runner.close()
    return out


def _time_calls(functions) -> dict[tuple[str, int], list[float]]:
    """Record the wall time of every verify and draft call of `functions` (a StepFunctions)."""
    calls: dict[tuple[str, int], list[float]] = defaultdict(list)
    verify, draft = functions.verify, functions.draft

    def timed_verify(kv_len, t):
        start = time.perf_counter()
        out = verify(kv_len, t)
        calls[("verify", t)].append(time.perf_counter() - start)
        return out

    def timed_draft(kv_len, window, k, *, eager=False):
        start = time.perf_counter()
        draft(kv_len, window, k, eager=eager)
        calls[("draft", k)].append(time.perf_counter() - start)

    functions.verify, functions.draft = timed_verify, timed_draft
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
        base, verify, _ = ms_per_step("none", [0], batch, args.steps, args.compile, args.dummy, args.dtype)[0]
        print(f"batch {batch}: none {base:.1f} ms (verify {verify:.1f})", flush=True)
        for method in args.methods:
            times = ms_per_step(method, args.ks, batch, args.steps, args.compile, args.dummy, args.dtype,
                                args.draft_dtype)
            row = ", ".join(f"K={k} {t:.1f} ms ({t / base:.2f}x; verify {v:.1f}, draft {d:.1f})"
                            for k, (t, v, d) in times.items())
            print(f"batch {batch}: {method} {row}", flush=True)


if __name__ == "__main__":
    main()
