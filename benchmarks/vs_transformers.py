"""Plain decoding throughput: specgen (`draft.method: none`) against transformers' `generate`.

Same model, same prompts (chat-templated), same number of new tokens per prompt (EOS ignored on both
sides so every prompt generates exactly --max-tokens), greedy, fp32 on CPU / bf16 on CUDA. Each side
runs once untimed first (warm-up, compilation), then timed; both sides in one process, one after the
other, so the ratio is measured under the same machine load.

    python benchmarks/vs_transformers.py --batch-sizes 1 8 --max-tokens 128 [--compile]
"""

from __future__ import annotations

import argparse
import time

import torch

from specgen.checkpoints import resolve_checkpoint
from specgen.data import read_prompts, tokenize_prompt
from specgen.job import build_runner, resolve
from specgen.pipelines.requests import Request
from specgen.recipe import load_recipe


def ours(recipe_path: str, batch: int, prompts: list[list[int]], max_tokens: int, compile: bool) -> float:
    recipe = load_recipe(recipe_path, [f"runtime.batch_size={batch}", "draft.method=none",
                                       "sampling.ignore_eos=true", f"runtime.compile={str(compile).lower()}"])
    runner, _, _ = build_runner(recipe, resolve(recipe), 0)

    def go(tag: str) -> float:
        requests = [Request(f"{tag}{i}", p, max_tokens, i) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        totals = runner.run(requests, lambda c: None)
        return totals.output_tokens / (time.perf_counter() - start)

    go("warm")
    timed = go("timed")
    runner.close()
    return timed


def transformers_generate(folder, batch: int, prompts: list[list[int]], max_tokens: int, device,
                          dtype, static: bool) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    pad = model.generation_config.pad_token_id or 0

    def go() -> float:
        produced, start = 0, time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i: i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
            kwargs = {"cache_implementation": "static"} if static else {}
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad, **kwargs)
            produced += (out.shape[1] - width) * len(chunk)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return produced / (time.perf_counter() - start)

    go()
    return go()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/smollm2-ar.yaml")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="use the first N default prompts")
    parser.add_argument("--compile", action="store_true", help="compile our step (runtime.compile)")
    parser.add_argument("--static", action="store_true", help="transformers with a static cache")
    args = parser.parse_args()

    recipe = load_recipe(args.recipe)
    r = resolve(recipe)
    folder = resolve_checkpoint(recipe.target.model)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenize_prompt(rec, tokenizer, True) for rec in read_prompts("default", limit=args.limit)]
    print(f"device {r.device}, dtype {r.dtype}, {len(prompts)} prompts, {args.max_tokens} new tokens each, "
          f"{torch.get_num_threads()} threads")
    for batch in args.batch_sizes:
        a = ours(args.recipe, batch, prompts, args.max_tokens, args.compile)
        b = transformers_generate(folder, batch, prompts, args.max_tokens, r.device, r.dtype, args.static)
        print(f"batch {batch}: specgen {a:,.1f} tok/s, transformers generate {b:,.1f} tok/s, "
              f"ratio {a / b:.2f}x", flush=True)


if __name__ == "__main__":
    main()
