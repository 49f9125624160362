"""How far a target kept quantized (`target.quantization`) is from the dense one: greedy agreement and
the log-probability it gives the dense model's tokens.

    python benchmarks/quantization_quality.py --recipe recipes/smollm2-ar.yaml --limit 64 --max-tokens 64

For each of int8 and int4 against the recipe's target in bf16 (on a GGUF target, int4 is what `auto`
keeps: the file's own 4-bit blocks, checkpoints/gguf_blocks.py; int8 requantizes its dequantised weights), on held-out ShareGPT prompts (chat
template, greedy, plain decoding): how many prompts give the very same tokens, the share of the dense
model's tokens produced before the first divergence (averaged over prompts), and the mean log-prob each
model gives the dense model's greedy tokens (teacher-forced: the prompt and the dense answer prefilled,
`sampling.prompt_logprobs`). A quantized target is a model of its own; speculative decoding on it is
exact against plain decoding on it (tests/test_quantized_linear.py); this says what the quantization
itself costs.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from specgen.bench.measure import bench_prompts
from specgen.checkpoints.gguf_blocks import gguf_source
from specgen.data import read_prompts
from specgen.job import build_runner, resolve
from specgen.machine import cpu_description
from specgen.pipelines.requests import Request
from specgen.recipe import load_recipe


def runner_for(recipe, kind: str, **sampling):
    recipe = replace(recipe, target=replace(recipe.target, quantization=kind, dtype="bfloat16"),
                     sampling=replace(recipe.sampling, temperature=0.0, stop=[], **sampling))
    return build_runner(recipe, resolve(recipe), 0)


def generate(runner, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out: dict[str, list[int]] = {}
    runner.run([Request(f"p{i}", p, max_tokens, i) for i, p in enumerate(prompts)],
               lambda c: out.__setitem__(c.id, c.token_ids))
    return [out[f"p{i}"] for i in range(len(prompts))]


def mean_logprob(runner, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """The mean log-prob the runner's target gives each answer token after its prompt."""
    records: dict[str, list] = {}
    requests = [Request(f"p{i}", p + a, 1, i) for i, (p, a) in enumerate(zip(prompts, answers)) if a]
    runner.run(requests, lambda c: records.__setitem__(c.id, c.prompt_logprobs))
    values = []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        if a:
            values += [e["logprob"] for e in records[f"p{i}"][len(p):] if e and e["logprob"] is not None]
    return statistics.fmean(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/smollm2-ar.yaml")
    parser.add_argument("--limit", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, ["draft.method=none", "runtime.batch_size=8", "runtime.device=cpu"])
    dense, tokenizer, _ = runner_for(recipe, "none")
    prompts, _ = bench_prompts(read_prompts("sharegpt-heldout"), tokenizer, recipe,
                               recipe.runtime.max_seq_len - args.max_tokens - 1, args.limit)
    reference = generate(dense, prompts, args.max_tokens)
    scorers = {kind: runner_for(recipe, kind, prompt_logprobs=0)[0] for kind in ("none", "int8", "int4")}
    print(f"{cpu_description()}; {args.recipe}, {len(prompts)} held-out ShareGPT prompts, greedy, "
          f"{args.max_tokens} new tokens; against the target in bf16")
    print(f"{'weights':<40} {'same tokens':>12} {'agreed before divergence':>25} {'mean log-prob of bf16 tokens':>29}")
    gguf = gguf_source(dense.resolved.target_config) is not None
    for kind in ("none", "int8", "int4"):
        label = {"none": "bf16", "int4": "int4 = auto (the GGUF's 4-bit blocks)" if gguf else "int4"}.get(kind, kind)
        got = reference if kind == "none" else generate(runner_for(recipe, kind)[0], prompts, args.max_tokens)
        same = sum(g == r for g, r in zip(got, reference))
        agreed = statistics.fmean(
            next((j for j, (x, y) in enumerate(zip(g, r)) if x != y), min(len(g), len(r))) / max(1, len(r))
            for g, r in zip(got, reference))
        score = mean_logprob(scorers[kind], prompts, reference)
        print(f"{label:<40} {f'{same}/{len(prompts)}':>12} {agreed:>25.1%} {score:>29.3f}")


if __name__ == "__main__":
    main()
