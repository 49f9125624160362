"""The `hf` baseline as `bench` measures it against transformers alone, in a fresh process.

`bench` runs transformers' `generate` in a child process of its own (`specgen/bench/hf.py`), so it
should go as fast as a user's own transformers script. This times both on the same job, alternating:

    python benchmarks/hf_in_bench.py recipes/smollm2-ar.yaml --prompts P --limit 8 --max-tokens 48

Each round runs `specgen bench --baselines hf` (its runs after a warm-up) and then a fresh Python
that loads the model with `HFGenerate`, warms up once and runs the same prompts as often. Both sides
report their FASTEST run per round (a busy machine only slows a run down) and the ratio of the two,
round by round. Timing belongs here, not in the tests: this shared 2-core VM has spells 30% slower.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ALONE = """
import json, torch
from pathlib import Path
from specgen.bench.hf import HFGenerate
from specgen.checkpoints.tokenizer import load_tokenizer
torch.set_num_threads({threads})
folder = Path({folder!r})
config = json.loads((folder / "config.json").read_text())
tokenizer = load_tokenizer(folder, config.get("vocab_size"))
ids = json.loads(Path({ids!r}).read_text())
model = HFGenerate(folder, torch.device("cpu"), getattr(torch, {dtype!r}), {ignore_eos}, tokenizer)
model.generate(ids[:{batch}], {batch}, {max_tokens})
runs = [model.generate(ids, {batch}, {max_tokens}) for _ in range({repeats})]
print(json.dumps(max(t / s for t, s in runs)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    from specgen.bench.measure import bench_prompts
    from specgen.checkpoints.tokenizer import load_tokenizer
    from specgen.data import read_prompts
    from specgen.job import resolve
    from specgen.recipe import load_recipe

    overrides = ["draft.method=none", f"runtime.threads={args.threads}"]
    recipe = load_recipe(args.recipe, overrides)
    resolved = resolve(recipe)
    folder = resolved.target_folder
    config = json.loads((folder / "config.json").read_text())
    tokenizer = load_tokenizer(folder, config.get("vocab_size"))
    ids, _ = bench_prompts(read_prompts(args.prompts), tokenizer, recipe,
                           recipe.runtime.max_seq_len - args.max_tokens, args.limit)
    work = Path(tempfile.mkdtemp(prefix="hf_in_bench-"))
    (work / "ids.json").write_text(json.dumps(ids))
    alone_script = textwrap.dedent(ALONE.format(
        threads=args.threads, folder=str(folder), ids=str(work / "ids.json"),
        dtype=str(resolved.dtype).removeprefix("torch."), ignore_eos=recipe.sampling.ignore_eos,
        batch=args.batch_size, max_tokens=args.max_tokens, repeats=args.repeats))
    for round_ in range(1, args.rounds + 1):
        report = work / f"bench-{round_}.json"
        subprocess.run([sys.executable, "-m", "specgen.cli", "bench", args.recipe, "--prompts", args.prompts,
                        "--limit", str(args.limit), "--batch-sizes", str(args.batch_size),
                        "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
                        "--baselines", "hf", "--no-split", "--output", str(report),
                        *(arg for o in overrides for arg in ("--set", o))], check=True, capture_output=True)
        in_bench = max(next(r for r in json.loads(report.read_text())["results"] if r["config"] == "hf")["samples"])
        alone = subprocess.run([sys.executable, "-c", alone_script], check=True, capture_output=True, text=True)
        alone_rate = json.loads(alone.stdout.strip().splitlines()[-1])
        print(f"round {round_}: hf in bench {in_bench:.1f} tok/s, alone {alone_rate:.1f} tok/s, "
              f"ratio {in_bench / alone_rate:.2f}", flush=True)


if __name__ == "__main__":
    main()
