"""The exactness table: speculative output against plain decoding's, token for token, under `dtype: auto`.

    python benchmarks/exactness.py                      # everything (about an hour on 2 CPU cores: compiles)
    python benchmarks/exactness.py --modes eager --methods eagle3 suffix --batches 1

For every cell (eager or compiled, batch size, threads, greedy or seeded sampling) it runs the plain
recipe and each speculative one (each shipped draft, and suffix drafting) as a user would, one
`specgen run` process each, on the same held-out ShareGPT prompts (`--prompts sharegpt-heldout`:
no shipped draft trained on them), and counts the prompts whose tokens equal the plain run's of the
same cell. A last column compares the plain run itself with the plain run at batch 1 and 1 thread
of the same mode: rows and threads must not change a token either. Nothing is timed.

K is pinned (`--k`, default 3; DFlash and suffix alike) rather than `auto`: a job this short would
mostly run auto's plain steps and the table would then compare plain decoding with itself. Seeded
sampling: temperature 0.8, top-p 0.9, seed 7 (argmax drafts, so every emitted token must be the very
token plain decoding samples: DESIGN.md's position-keyed noise).
Outputs go to `--out` (default outputs/exactness/); a cell already there is not run again.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

from specgen.machine import cpu_description

RECIPES = {"plain": "recipes/smollm2-ar.yaml", "eagle3": "recipes/smollm2-eagle3.yaml",
           "dflash": "recipes/smollm2-dflash.yaml", "mtp": "recipes/smollm2-mtp.yaml",
           "suffix": "recipes/smollm2-suffix.yaml"}
SAMPLING = {"greedy": ["sampling.temperature=0"],
            "seeded": ["sampling.temperature=0.8", "sampling.top_p=0.9", "sampling.seed=7"]}


def cpu_name() -> str:
    return cpu_description()


def run(method: str, mode: str, batch: int, threads: int, sampling: str, args, out: Path) -> dict[str, list[int]]:
    """One `specgen run`; returns {prompt id: token ids} (errors left out)."""
    path = out / f"{method}-{mode}-b{batch}-t{threads}-{sampling}.jsonl"
    if not (path.exists() and Path(f"{path}.stats.json").exists()):
        sets = [f"runtime.batch_size={batch}", f"runtime.threads={threads}",
                f"runtime.compile={'true' if mode == 'compiled' else 'false'}",
                f"sampling.max_tokens={args.max_tokens}", "sampling.ignore_eos=false", *SAMPLING[sampling]]
        if method != "plain":
            sets += [f"draft.num_speculative_tokens={args.k}", "draft.max_speculative_tokens=null"]
        command = [sys.executable, "-m", "specgen", "run", RECIPES[method], "--prompts", "sharegpt-heldout",
                   "--limit", str(args.prompts), "--no-resume", "--output", str(path)]
        for s in sets:
            command += ["--set", s]
        done = subprocess.run(command, capture_output=True, text=True)
        header = next((line for line in done.stdout.splitlines() if line.startswith("cpu")), "")
        print(f"  {path.name}: exit {done.returncode} {header}", flush=True)
        if done.returncode not in (0, 3):
            print(done.stdout[-2000:], done.stderr[-2000:], sep="\n")
            return {}
    tokens = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("error") is None:
            tokens[record["id"]] = record["token_ids"]
    return tokens


def same(a: dict, b: dict) -> str:
    common = a.keys() & b.keys()
    return f"{sum(a[i] == b[i] for i in common)}/{len(common)}" if common else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--sampling", nargs="+", default=["greedy", "seeded"], choices=list(SAMPLING))
    parser.add_argument("--methods", nargs="+", default=["eagle3", "dflash", "mtp", "suffix"],
                        choices=[m for m in RECIPES if m != "plain"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("outputs/exactness"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{cpu_name()}; dtype auto; {args.prompts} held-out ShareGPT prompts, {args.max_tokens} tokens, K = {args.k}")
    rows = []
    for mode, sampling, batch, threads in itertools.product(args.modes, args.sampling, args.batches, args.threads):
        plain = run("plain", mode, batch, threads, sampling, args, args.out)
        base = run("plain", mode, 1, 1, sampling, args, args.out) if (batch, threads) != (1, 1) else plain
        cells = [same(run(m, mode, batch, threads, sampling, args, args.out), plain) for m in args.methods]
        rows.append([mode, sampling, str(batch), str(threads), *cells, same(plain, base)])
    head = ["mode", "sampling", "batch", "threads", *[f"{m} = plain" for m in args.methods], "plain = plain b1 t1"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()
