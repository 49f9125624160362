"""Where a plain decode step's time goes with the target kept bf16, int8 and int4: the layers' products
(GEMMs), the LM head, and the rest (attention, norms, RoPE, sampling, the step's own overhead), beside
the bytes each part reads.

    python benchmarks/step_split.py --recipe recipes/smollm2-ar.yaml --steps 64

For each weight format (`target.quantization` none in bf16, int8, int4; on a GGUF target int4 is what
`auto` keeps: the file's own 4-bit blocks), one slot, a job of `--steps` greedy tokens after a short
prompt, through eager steps and through a compiled one (`runtime.compile: true`, what a long job
runs), each step's wall time on the runner's own clock. The products are timed by themselves at one
row (each layer's products called in a loop with the step's input shape: the kernels the eager step
calls), and the head likewise; what is left of the eager step is attention and the rest. Every figure
is the median of `--rounds` rounds that run every format in turn, so that a slow spell of a shared
machine hits each alike. Weight bytes are what each part's tensors hold (codes and scales); a decode
step reads each of them once.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from torch import nn

from specgen.job import build_runner, resolve
from specgen.machine import cpu_description
from specgen.models.quantized import QuantizedLinear
from specgen.pipelines.requests import Request
from specgen.recipe import load_recipe


def weight_bytes(module: nn.Module) -> int:
    if isinstance(module, QuantizedLinear):
        return module.quantized.nbytes()
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def per_call_ms(call, repeats: int) -> float:
    for _ in range(3):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return 1000 * (time.perf_counter() - start) / repeats


PROMPT = list(range(100, 116))
KINDS = (("none", "bf16"), ("int8", "int8"), ("int4", "int4"))


def build(recipe, kind: str, compile: bool):
    recipe = replace(recipe, target=replace(recipe.target, quantization=kind, dtype="bfloat16"),
                     runtime=replace(recipe.runtime, batch_size=1, compile=compile),
                     sampling=replace(recipe.sampling, temperature=0.0, stop=[], ignore_eos=True))
    runner, _, _ = build_runner(recipe, resolve(recipe), 0)
    runner.run([Request("warm", PROMPT, 8, 0)], lambda c: None)
    return runner


def job_step_ms(runner, steps: int, tag: str) -> float:
    totals = runner.run([Request(tag, PROMPT, steps, 1)], lambda c: None)
    return 1000 * totals.step_seconds / max(1, totals.steps)


@torch.inference_mode()
def parts_ms(target) -> tuple[float, float]:
    """(the layers' products, the head), ms at one row."""
    products = [m for layer in target.model.layers for m in layer.modules()
                if isinstance(m, (nn.Linear, QuantizedLinear))]
    row = torch.randn(1, 1, target.hidden_size, dtype=torch.bfloat16)
    inputs = {id(m): torch.randn(1, 1, m.in_features, dtype=torch.bfloat16) for m in products}
    return (per_call_ms(lambda: [m(inputs[id(m)]) for m in products], 10),
            per_call_ms(lambda: target.head(row), 30))


def bytes_of(target) -> tuple[int, int]:
    products = [m for layer in target.model.layers for m in layer.modules()
                if isinstance(m, (nn.Linear, QuantizedLinear))]
    head = target.lm_head
    return (sum(weight_bytes(m) for m in products),
            weight_bytes(head) if isinstance(head, QuantizedLinear) else head.weight.numel() * 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="recipes/smollm2-ar.yaml")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, ["draft.method=none", "runtime.device=cpu"])
    print(f"{cpu_description()}; {args.recipe}; one slot, {torch.get_num_threads()} threads, "
          f"{args.steps} greedy tokens after 16 prompt tokens")
    print(f"{'weights':<8} {'compiled step ms':>16} {'eager step ms':>13} {'GEMMs ms':>9} {'GEMM MiB':>9} "
          f"{'head ms':>8} {'head MiB':>9} {'rest ms (attention, norms, sampling)':>37}")
    runners = {(kind, compile): build(recipe, kind, compile) for kind, _ in KINDS for compile in (False, True)}
    samples: dict[tuple, list[float]] = {key: [] for key in runners}
    parts: dict[str, list[tuple[float, float]]] = {kind: [] for kind, _ in KINDS}
    for n in range(args.rounds):          # interleaved: a slow spell of the machine hits every format
        for (kind, compile), runner in runners.items():
            samples[kind, compile].append(job_step_ms(runner, args.steps, f"r{n}"))
            if not compile:
                parts[kind].append(parts_ms(runner.unified.target))
    for kind, label in KINDS:
        eager = statistics.median(samples[kind, False])
        gemms = statistics.median(p[0] for p in parts[kind])
        head = statistics.median(p[1] for p in parts[kind])
        gemm_bytes, head_bytes = bytes_of(runners[kind, False].unified.target)
        print(f"{label:<8} {statistics.median(samples[kind, True]):>16.2f} {eager:>13.2f} {gemms:>9.2f} "
              f"{gemm_bytes / 2**20:>9.1f} {head:>8.2f} {head_bytes / 2**20:>9.1f} {eager - gemms - head:>37.2f}")
    per_token = runners[KINDS[0][0], False].unified.target.cache_bytes_per_token(torch.bfloat16)
    print(f"(the KV cache reads {per_token:,} bytes a token of context in bf16)")


if __name__ == "__main__":
    main()
