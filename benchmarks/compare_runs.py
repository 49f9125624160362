"""Compare a speculative run with a plain one: identical outputs, and the speed-up. `make demo` ends here.

    python benchmarks/compare_runs.py outputs/smollm2-eagle3.jsonl outputs/smollm2-ar.jsonl

Reads both results files (token ids per prompt id) and their `.stats.json`. Exit code 1 when a prompt's
tokens differ (greedy speculative decoding must reproduce plain decoding exactly).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read(path: Path) -> tuple[dict[str, list[int]], dict]:
    tokens = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("error") is None:
            tokens[record["id"]] = record["token_ids"]
    return tokens, json.loads(Path(f"{path}.stats.json").read_text())


def main(spec_path: str, plain_path: str) -> int:
    spec, spec_stats = read(Path(spec_path))
    plain, plain_stats = read(Path(plain_path))
    common = sorted(spec.keys() & plain.keys())
    differ = [i for i in common if spec[i] != plain[i]]
    a = spec_stats["steady_output_tokens_per_second"] or spec_stats["output_tokens_per_second"]
    b = plain_stats["steady_output_tokens_per_second"] or plain_stats["output_tokens_per_second"]
    mal = spec_stats["spec"]["mean_acceptance_length"]
    print(f"{len(common)} prompts in both runs: {len(common) - len(differ)} with identical tokens"
          + (f", {len(differ)} DIFFERENT ({', '.join(differ[:5])})" if differ else ""))
    if a and b:
        print(f"speculative {a:,.1f} tok/s vs plain {b:,.1f} tok/s = {a / b:.2f}x "
              f"(mean acceptance length {mal:.2f}; steady state, compile time left out)" if mal else
              f"speculative {a:,.1f} tok/s vs plain {b:,.1f} tok/s = {a / b:.2f}x")
    end_a, end_b = spec_stats["output_tokens_per_second"], plain_stats["output_tokens_per_second"]
    if end_a and end_b:
        print(f"end to end (compiling included): {end_a:,.1f} vs {end_b:,.1f} tok/s = {end_a / end_b:.2f}x")
    k_steps = (spec_stats.get("speculation") or {}).get("k_steps")
    if k_steps and not any(k_steps[1:]):
        print(f"auto ran plain steps only: on this job ({sum(len(t) for t in spec.values()):,} tokens) no "
              "draft variant would repay its compile time (docs/choosing-a-draft.md: what auto does)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
