"""End to end on real prompts: specgen plain decoding against transformers' `generate`, warm-ups counted.

The job a user runs: the first N ShareGPT first turns (chat-templated, ragged lengths), greedy, EOS
honoured, at most --max-tokens new tokens each. Each side runs in its own child process, one after
the other (never two heavy jobs at once), and is timed twice over the same prompts:
- end to end: from a loaded model to the last token, so compilation, warm-ups and prefill count;
- steady state: the same prompts again in the same process, everything already compiled.
Tokens counted are the real output tokens (up to and including EOS). Model loading is excluded on
both sides and printed apart. Prompts longer than --max-prompt tokens are skipped on both sides.

    python benchmarks/sharegpt_e2e.py --limit 48 --batch-size 16 --max-tokens 128
    python benchmarks/sharegpt_e2e.py --limit 128 --batch-size 32 --set runtime.compile=false
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def shared_prompts(folder, limit: int, max_prompt: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from specgen.data import read_prompts, tokenize_prompt

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for record in read_prompts("sharegpt"):
        if record.error:
            continue
        ids = tokenize_prompt(record, tokenizer, True)
        if len(ids) <= max_prompt:
            prompts.append(ids)
        if len(prompts) == limit:
            break
    return prompts


def specgen_side(args) -> dict:
    import torch

    from specgen.job import build_runner, resolve
    from specgen.pipelines.requests import Request
    from specgen.recipe import load_recipe

    recipe = load_recipe(args.recipe, ["draft.method=none", f"runtime.batch_size={args.batch_size}",
                                       f"sampling.max_tokens={args.max_tokens}", *args.set])
    r = resolve(recipe)
    prompts = shared_prompts(r.target_folder, args.limit, args.max_prompt)
    start = time.perf_counter()
    runner, _, notes = build_runner(recipe, r, 0)
    load = time.perf_counter() - start
    out = {"load_s": load, "notes": notes, "prompts": len(prompts),
           "prompt_tokens": sum(map(len, prompts))}
    for tag in ("end_to_end", "steady"):
        requests = [Request(f"{tag}{i}", p, args.max_tokens, i) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        totals = runner.run(requests, lambda c: None)
        seconds = time.perf_counter() - start
        out[tag] = {"seconds": seconds, "tokens": totals.output_tokens,
                    "tok_s": totals.output_tokens / seconds,
                    "compile_s": getattr(totals, "compile_seconds", None)}
    out["threads"] = torch.get_num_threads()
    out["header"] = getattr(runner, "header", None)
    return out


def transformers_side(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from specgen.checkpoints import resolve_checkpoint
    from specgen.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    folder = resolve_checkpoint(recipe.target.model)
    prompts = shared_prompts(folder, args.limit, args.max_prompt)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    load = time.perf_counter() - start
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = model.generation_config.pad_token_id or 0
    out = {"load_s": load, "prompts": len(prompts), "threads": torch.get_num_threads()}
    for tag in ("end_to_end", "steady"):
        produced, start = 0, time.perf_counter()
        for i in range(0, len(prompts), args.batch_size):
            chunk = prompts[i: i + args.batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_tokens,
                                     do_sample=False, pad_token_id=pad)
            for row in gen[:, width:].tolist():
                ends = [j for j, t in enumerate(row) if t in eos]
                produced += ends[0] + 1 if ends else len(row)
        seconds = time.perf_counter() - start
        out[tag] = {"seconds": seconds, "tokens": produced, "tok_s": produced / seconds}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-ar.yaml")
    parser.add_argument("--limit", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--set", action="append", default=[], help="recipe override for specgen (a.b=v)")
    parser.add_argument("--side", choices=("both", "specgen", "transformers"), default="both")
    args = parser.parse_args()
    if args.side != "both":
        result = specgen_side(args) if args.side == "specgen" else transformers_side(args)
        print(json.dumps(result))
        return
    results = {}
    for side in ("specgen", "transformers"):
        cmd = [sys.executable, __file__, "--side", side, *sys.argv[1:]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{side} failed:\n{proc.stderr[-3000:]}")
        results[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    s, t = results["specgen"], results["transformers"]
    print(f"{s['prompts']} ShareGPT prompts ({s['prompt_tokens']} prompt tokens), batch {args.batch_size}, "
          f"<= {args.max_tokens} new tokens, greedy, EOS honoured; specgen {' '.join(args.set) or 'recipe'}")
    for tag in ("end_to_end", "steady"):
        a, b = s[tag], t[tag]
        compile_s = f", compile {a['compile_s']:.1f} s" if a.get("compile_s") is not None else ""
        print(f"{tag:>10}: specgen {a['tok_s']:,.1f} tok/s ({a['tokens']} tokens, {a['seconds']:.1f} s"
              f"{compile_s}), transformers {b['tok_s']:,.1f} tok/s ({b['tokens']} tokens, "
              f"{b['seconds']:.1f} s): {a['tok_s'] / b['tok_s']:.2f}x")
    print(f"model load: specgen {s['load_s']:.1f} s, transformers {t['load_s']:.1f} s; "
          f"threads: specgen {s.get('threads')}, transformers {t.get('threads')}")
    for note in s.get("notes") or []:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
