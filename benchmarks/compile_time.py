"""What compiling one step variant costs a run, from an empty cache and then from the cache that run left.

Each run is a process of its own (as a user's job is): it builds the runner of a shipped recipe, then
times `runner.warm_up()`, which compiles the variant (k = 0: the plain step of `draft.method: none`;
k >= 1: the EAGLE-3 step of k drafts), and reports Inductor's graph-cache hits and misses. The first
run starts from an empty Inductor cache; each later one reuses the folder the earlier ones filled.
Inductor's precompiled C++ header (in /tmp, shared by every cache) is built before the first run.

    python benchmarks/compile_time.py [--k 0] [--dtype float32] [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def one_run(k: int, dtype: str) -> dict:
    import torch
    from torch._dynamo.utils import counters

    from specgen.job import build_runner, resolve
    from specgen.recipe import load_recipe

    overrides = ["runtime.batch_size=1", "runtime.compile=true", f"target.dtype={dtype}", "train=null"]
    if k:
        overrides += [f"draft.num_speculative_tokens={k}", "draft.max_speculative_tokens=null"]
    recipe = load_recipe("recipes/smollm2-ar.yaml" if k == 0 else "recipes/smollm2-eagle3.yaml", overrides)
    runner, _, _ = build_runner(recipe, resolve(recipe), 0)
    start = time.perf_counter()
    runner.warm_up()
    seconds = time.perf_counter() - start
    cache = counters["inductor"]
    return {"seconds": round(seconds, 1), "graph_cache_hits": cache["fxgraph_cache_hit"],
            "graph_cache_misses": cache["fxgraph_cache_miss"],
            "bypassed": cache["fxgraph_cache_bypass"], "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=0,
                        help="0: the plain step; k >= 1: EAGLE-3's step of k drafts")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.k, args.dtype)))
        return
    subprocess.run([sys.executable, "-c", "import torch; torch.compile(lambda x: x.sin())(torch.ones(8))"],
                   check=True)
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=folder)
        for run in range(1, args.runs + 1):
            command = [sys.executable, __file__, "--child", "--k", str(args.k), "--dtype", args.dtype]
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            state = "empty cache" if run == 1 else "the cache of the runs before"
            print(f"run {run} ({state}): compile {result['seconds']} s; graph cache: "
                  f"{result['graph_cache_hits']} hit, {result['graph_cache_misses']} miss, "
                  f"{result['bypassed']} bypassed ({result['threads']} threads)")


if __name__ == "__main__":
    main()
