"""Cost of one speculative step relative to one plain decode step, per draft method and K.

One step drafts k tokens per slot and verifies k + 1. This script times steps of each shipped draft
(the recipes' own checkpoints) at every K asked, and of plain decoding (`draft.method: none`), on the
same target, prompts and batch size, in one process, and prints the ratio: the acceptance length a
draft needs to break even at that K, and the median time of the step's call (compiled: one call,
the draft and the verify of k + 1 rows; meaningful on CPU, where a call returns when its work is
done; on CUDA it returns once the work is queued), the rest of a step being the host's. Every K of
a draft runs on one runner, each variant compiled once, as `num_speculative_tokens: auto` runs it.
Every runner is built and warmed up first, then the timed runs go round them `--rounds` times
(plain, then each draft at each K), and each figure is the median over its rounds: a VM's speed
drifts by 10-20% over minutes, which runs one after the other read as a difference between them.
`--dummy` swaps in random-init drafts of the published layouts instead (EAGLE-3's then has the
target's whole vocabulary as its head, where the shipped draft has 8,192 rows). `--target-recipe`
times another target (e.g. recipes/llama3.1-8b-dummy-ar.yaml, the Llama-3.1-8B shape with random
weights): plain decoding with that recipe, each method as that recipe with a random-init draft of the
method (so `--dummy` is implied); `--set KEY=VALUE` overrides every recipe (e.g. fewer layers to
rehearse a GPU run on a CPU: `--set target.hf_overrides.num_hidden_layers=1`).

`--profile` adds, per configuration, where a step's time goes (CPU, compiled): the torch profiler
over one more run, Inductor's kernels timed one by one, in ms a step: the target's GEMMs (those of
k + 1 rows per slot), the draft's GEMMs (the other rows), decode attention, Inductor's other fused
kernels, the Python of the compiled graph between its kernels, and the eager prefill's GEMMs
(spread over the run's steps). It compiles every step again (kernel timers change the code).

    python benchmarks/step_cost.py --batch-sizes 1 8 --ks 1 2 3 [--compile] [--dummy] [--profile]
        [--dtype float32] [--draft-dtype float32] [--rounds 5] [--target-recipe R.yaml] [--set K=V ...]
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict

from specgen.job import build_runner, resolve
from specgen.pipelines.policy import FixedPolicy
from specgen.pipelines.requests import Request
from specgen.recipe import load_recipe

RECIPES = {"none": "recipes/smollm2-ar.yaml", "eagle3": "recipes/smollm2-eagle3.yaml",
           "dflash": "recipes/smollm2-dflash.yaml", "mtp": "recipes/smollm2-mtp.yaml"}


class Timed:
    """A runner of one method, its prompts, and the wall time of each call of its step functions."""

    def __init__(self, method: str, ks: list[int], batch: int, compile: bool, dummy: bool, dtype: str,
                 draft_dtype: str, target_recipe: str | None = None, extra: list[str] = ()) -> None:
        overrides = [f"runtime.batch_size={batch}", "sampling.ignore_eos=true", "train=null",
                     f"runtime.compile={str(compile).lower()}", f"target.dtype={dtype}", *extra]
        path = RECIPES[method]
        if target_recipe is not None:
            path, dummy = target_recipe, True
            if method != "none":
                overrides.append(f"draft.method={method}")
        if method != "none":
            overrides += ["draft.num_speculative_tokens=auto", f"draft.max_speculative_tokens={max(*ks, 1)}",
                          f"draft.dtype={draft_dtype}"]
            if dummy:
                overrides += ["draft.load_format=dummy", "draft.model=null"]
        recipe = load_recipe(path, overrides)
        self.runner, tokenizer, _ = build_runner(recipe, resolve(recipe), 0)
        self.prompts = [tokenizer.encode(f"Tell me a story about the number {i}.") for i in range(batch)]
        self.calls = _time_calls(self.runner.functions)

    def run(self, k: int, tag: str, tokens: int) -> int:
        """One job of `tokens` tokens per slot at k drafts a step: its steps (timed by `calls`)."""
        self.runner.use_policy(FixedPolicy(k))
        requests = [Request(f"{tag}{i}", p, tokens, i) for i, p in enumerate(self.prompts)]
        return self.runner.run(requests, lambda c: None).steps


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


def breakdown(events, k: int, batch: int, steps: int) -> dict[str, float]:
    """Profiler events of one run -> ms a step by part (the module docstring)."""
    parts: dict[str, float] = defaultdict(float)
    for event in events:
        gemm = re.match(r"graph_\d+_gemm_m(s?)(\d+)n\d+k\d+", event.key)
        if gemm:
            rows = int(gemm.group(2))
            part = "target gemm" if not gemm.group(1) and rows == batch * (k + 1) else "draft gemm"
            if event.count < steps / 2:          # once per job: the prefill's, compiled
                part = "prefill"
        elif event.key.startswith("graph_") and "cpp_fused" in event.key:
            part = "fused"
        elif "decode_attention" in event.key:
            part = "attention"
        elif event.key.startswith("## Call CompiledFxGraph"):
            part = "graph python"
        elif event.key == "aten::mm":
            part = "prefill"
        else:
            continue
        parts[part] += event.self_cpu_time_total / 1000 / steps
    return dict(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--methods", nargs="+", default=["eagle3", "dflash", "mtp"])
    parser.add_argument("--steps", type=int, default=48, help="tokens per slot in each timed run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--profile", action="store_true", help="where a step's time goes (CPU, compiled)")
    parser.add_argument("--dtype", default="auto", help="target.dtype (auto: the recipe's choice)")
    parser.add_argument("--draft-dtype", default="auto", help="draft.dtype (auto: bf16 where native)")
    parser.add_argument("--dummy", action="store_true", help="random-init drafts instead of the shipped ones")
    parser.add_argument("--target-recipe", help="another target's plain recipe (drafts random-init)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override")
    args = parser.parse_args()
    if args.profile and not args.compile:
        parser.error("--profile times a compiled step's kernels: add --compile")
    if args.profile:
        import torch._inductor.config as inductor
        inductor.cpp.enable_kernel_profile = True
    for batch in args.batch_sizes:
        timed = {m: Timed(m, args.ks, batch, args.compile, args.dummy, args.dtype, args.draft_dtype,
                          args.target_recipe, args.set)
                 for m in ["none", *args.methods]}
        configs = [(m, k) for m in timed for k in ([0] if m == "none" else args.ks)]
        for m, k in configs:        # same lengths as the timed runs: every compiled variant is built here
            timed[m].run(k, f"warm{k}-", args.steps)
        walls, medians = defaultdict(list), defaultdict(list)
        for r in range(args.rounds):
            for m, k in configs:
                timed[m].calls.clear()
                start = time.perf_counter()
                steps = timed[m].run(k, f"r{r}k{k}-", args.steps)
                walls[m, k].append((time.perf_counter() - start) / steps * 1000)
                medians[m, k].append(statistics.median(timed[m].calls[k]) * 1000 if timed[m].calls[k] else 0.0)
        base = statistics.median(walls["none", 0])
        for m in timed:
            row = ", ".join(f"K={k} {statistics.median(walls[m, k]):.1f} ms "
                            f"({statistics.median(walls[m, k]) / base:.2f}x; call {statistics.median(medians[m, k]):.1f})"
                            for k in ([0] if m == "none" else args.ks))
            print(f"batch {batch}: {m} {row}", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            for m, k in configs:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    steps = timed[m].run(k, f"profile{k}-", args.steps)
                parts = breakdown(prof.key_averages(), k, batch, steps)
                print(f"batch {batch}: {m} K={k} ms a step: "
                      + ", ".join(f"{p} {v:.2f}" for p, v in sorted(parts.items())), flush=True)
        for t in timed.values():
            t.runner.close()


if __name__ == "__main__":
    main()
