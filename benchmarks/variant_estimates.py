"""How far the warm-up's estimate of an uncompiled variant is from its compiled time.

`num_speculative_tokens: auto` compiles the plain step at warm-up and estimates every other variant
k (the draft of k tokens and the verify of k + 1 rows a slot) from eager times (pipelines/profile.py),
with a floor: the plain step's verify plus the variant's draft. This script runs that warm-up for a
recipe, then compiles the variants asked and times them the way the profile does (median of a few
calls, all slots inactive), and prints estimate, floor and compiled time per variant (its draft and
verify, one graph), beside the eager time of its verify alone.

    python benchmarks/variant_estimates.py recipes/smollm2-mtp.yaml --ks 1 2 [--batch-size 1]
        [--dtype float32]
"""

from __future__ import annotations

import argparse

import torch

from specgen.job import build_runner, resolve
from specgen.pipelines.policy import AdaptivePolicy
from specgen.pipelines.profile import median_seconds
from specgen.recipe import load_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    recipe = load_recipe(args.recipe, [f"target.dtype={args.dtype}", "runtime.compile=true",
                                       f"runtime.batch_size={args.batch_size}",
                                       "draft.num_speculative_tokens=auto"])
    resolved = resolve(recipe)
    # a job of one step's tokens: the warm-up estimates every variant and compiles none of them
    runner, _, _ = build_runner(recipe, resolved, 0, expected_steps=1, expected_tokens=1)
    policy = runner.policy
    assert isinstance(policy, AdaptivePolicy), "the recipe's draft must take num_speculative_tokens: auto"
    bad = [k for k in args.ks if not 1 <= k <= policy.k_max]
    if bad:
        parser.error(f"--ks: {bad} outside 1..{policy.k_max} (the recipe's max_speculative_tokens)")
    runner.warm_up()
    width = args.batch_size
    estimates = {k: policy.cost(k, width) for k in args.ks}
    floors = {k: policy.floor(k, width) for k in args.ks}
    f, kv = runner.functions, runner.kv_bucket(0)
    unified = f.unified
    with torch.inference_mode():
        key_index = f.key_index(kv)
        plain = median_seconds(f.device, lambda: f.verify(kv, 1), 7)
        eager_plain = median_seconds(f.device, lambda: unified.verify_block(f.state, f.caches, f.sampling, key_index,
                                                                  torch.arange(1, device=f.device)), 3)
        print(f"{args.recipe}, batch {width}, {args.dtype}, {torch.get_num_threads()} threads")
        print(f"plain step: compiled {1e3 * plain:.1f} ms, eager {1e3 * eager_plain:.1f} ms")
        for k in args.ks:
            f.step(kv, k + 1, k)           # compiles
            step = median_seconds(f.device, lambda: f.step(kv, k + 1, k), 7)
            eager_verify = median_seconds(f.device, lambda: unified.verify_block(f.state, f.caches, f.sampling, key_index,
                                                                        torch.arange(k + 1, device=f.device)), 3)
            floor = f"{1e3 * floors[k]:.1f}" if floors[k] is not None else "-"
            print(f"k = {k}: estimated {1e3 * estimates[k]:.1f} ms (floor {floor}); compiled "
                  f"{1e3 * step:.1f} ms; eager verify of {k + 1} rows {1e3 * eager_verify:.1f} ms")
        runner.state.active.zero_()


if __name__ == "__main__":
    main()
