"""What exactness costs on CPU: eager steps with row-invariant products against the BLAS, and prefill alone.

    python benchmarks/invariance_cost.py [--recipe recipes/smollm2-eagle3.yaml] [--dtype auto] [--rounds 5]

Times, in one process on the real model (SmolLM2 and its shipped draft):
- an eager step (the draft of k tokens and the verify of k + 1 rows per slot; k = 0 is the plain
  step) with the row-invariant products and attention the runner uses (kernels/cpu_linear.py,
  cpu_attention.py), against the same step through the BLAS and SDPA's reference path (what eager
  steps ran before: not row-invariant), at 1 and 8 slots, 200 cached positions;
- the prefill of 8 held-out ShareGPT prompts, each alone (the runner's CPU plan) against grouped.
The two sides of each line are interleaved round by round (`--rounds`) and the medians printed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specgen.data import read_prompts, tokenize_prompt
from specgen.job import build_runner, resolve
from specgen.models import attention as attention_module
from specgen.pipelines.prefill import PrefillItem
from specgen.recipe import load_recipe


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-eagle3.yaml")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    for slots in (1, 8):
        recipe = load_recipe(args.recipe, [f"runtime.batch_size={slots}", "runtime.compile=false",
                                           f"target.dtype={args.dtype}", "draft.num_speculative_tokens=3",
                                           "draft.max_speculative_tokens=null"])
        runner, tokenizer, _ = build_runner(recipe, resolve(recipe), 0)
        functions, unified, state = runner.functions, runner.unified, runner.state
        state.cache_lens.fill_(200)
        state.limit.fill_(1000)
        state.active.fill_(True)
        kv = runner.kv_bucket(200)
        key_index = functions.key_index(kv)
        invariant = attention_module.cpu_attention.supports

        def blas(k: int) -> None:
            # the step as eager steps ran it before: the BLAS's products, SDPA's reference attention
            attention_module.cpu_attention.supports = lambda *a: False
            try:
                if k:
                    unified.draft_block(state, runner.caches, runner.sampling, key_index,
                                        torch.arange(k + 1), k)
                unified.verify_block(state, runner.caches, runner.sampling, key_index, torch.arange(k + 1))
            finally:
                attention_module.cpu_attention.supports = invariant

        with torch.inference_mode():
            for k in (0, 1, 3):
                def ours(k=k):
                    return functions.step(kv, k + 1, k) if k else functions.verify(kv, 1)

                for call in (ours, lambda k=k: blas(k)):        # warm both
                    call()
                    state.cache_lens.fill_(200)
                times = {"invariant": [], "blas": []}
                for _ in range(args.rounds):
                    for name, call in (("invariant", ours), ("blas", lambda k=k: blas(k))):
                        times[name].append(seconds(call))
                        state.cache_lens.fill_(200)
                        state.active.fill_(True)
                a, b = statistics.median(times["invariant"]), statistics.median(times["blas"])
                print(f"{runner.resolved.dtype} eager step, {slots} slot(s), k = {k}: row-invariant "
                      f"{a * 1e3:.1f} ms, BLAS {b * 1e3:.1f} ms ({a / b:.2f}x)", flush=True)
        if slots == 8:
            prompts = [tokenize_prompt(r, tokenizer, True)
                       for r in read_prompts("sharegpt-heldout", limit=8) if r.error is None]
            items = [PrefillItem(b, list(p), 0, len(p) + 1) for b, p in enumerate(prompts)]
            with torch.inference_mode():
                times = {True: [], False: []}
                for _ in range(max(1, args.rounds // 2)):
                    for alone in (True, False):
                        runner.prefill.alone = alone
                        times[alone].append(seconds(lambda: runner.prefill.items(items)))
            a, b = statistics.median(times[True]), statistics.median(times[False])
            print(f"{runner.resolved.dtype} prefill of {len(items)} prompts ({sum(map(len, prompts))} tokens): "
                  f"alone {a:.2f} s, grouped {b:.2f} s ({a / b:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
