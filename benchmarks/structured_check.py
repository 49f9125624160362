"""Structured output on the real model: every output parses and validates, and speculation changes nothing.

Runs the recipes given (default: SmolLM2 plain, EAGLE-3, MTP, DFlash and suffix drafting) on the 32
entity prompts (benchmarks/prompts/json-entities.jsonl) under a response format (default: the entity
schema of benchmarks/formats/entity.json: required fields, an enum, a nested array), greedy, and
prints per recipe: outputs that parse and validate (jsonschema), outputs token-identical to the first
recipe's (plain decoding), acceptance length and tokens/s.

    python benchmarks/structured_check.py [--batch-size 8] [--max-tokens 256] [recipes...]

Needs `pip install jsonschema` (a checker only; specgen does not use it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import jsonschema

from specgen.cli import read_response_format
from specgen.job import run_job
from specgen.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPES = [f"recipes/smollm2-{name}.yaml" for name in ("ar", "eagle3", "mtp", "dflash", "suffix")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", default=[str(ROOT / r) for r in RECIPES])
    parser.add_argument("--prompts", default=str(ROOT / "benchmarks/prompts/json-entities.jsonl"))
    parser.add_argument("--response-format", default=str(ROOT / "benchmarks/formats/entity.json"))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--set", action="append", default=[], help="recipe override a.b=value (every recipe)")
    args = parser.parse_args()
    fmt = read_response_format(Path(args.response_format))
    raw = json.loads(Path(args.response_format).read_text())
    schema = raw.get("schema") or raw.get("json_schema", {}).get("schema")
    sets = [f"runtime.batch_size={args.batch_size}", f"sampling.max_tokens={args.max_tokens}",
            "sampling.temperature=0", *args.set]
    first = None
    with tempfile.TemporaryDirectory() as folder:
        for path in args.recipes:
            recipe = load_recipe(path, sets)
            recipe = replace(recipe, sampling=replace(recipe.sampling, response_format=fmt))
            out = Path(folder) / f"{Path(path).stem}.jsonl"
            summary = run_job(recipe, prompts=args.prompts, output=str(out), resume=False)
            records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
            valid = 0
            for r in records.values():
                try:
                    value = json.loads(r["text"])
                    if schema is not None:
                        jsonschema.validate(value, schema)
                    valid += 1
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    pass
            tokens = {i: r["token_ids"] for i, r in records.items()}
            first = first or tokens
            same = sum(tokens[i] == first.get(i) for i in tokens)
            spec = summary.stats.get("spec") or {}
            length = spec.get("mean_acceptance_length")
            masks = summary.stats.get("structured") or {}
            print(f"{Path(path).stem:>16}: valid {valid}/{len(records)}, identical to {Path(args.recipes[0]).stem} "
                  f"{same}/{len(records)}, acceptance length {length if length is None else round(length, 2)}, "
                  f"{summary.stats.get('output_tokens_per_second') or 0:.1f} tok/s, masks "
                  f"{masks.get('mask_ms_per_step', 0):.2f} of {masks.get('step_ms', 0):.1f} ms a step, "
                  f"{masks.get('grammar_draft_tokens', 0)} drafts forced by the grammar of "
                  f"{spec.get('num_draft_tokens', 0)}, {masks.get('refused_draft_steps', 0)} slot-steps stopped at a "
                  f"refused draft "
                  f"(finish: {sorted({r['finish_reason'] for r in records.values()})})", flush=True)


if __name__ == "__main__":
    main()
