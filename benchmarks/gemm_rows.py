"""Time of one compiled CPU GEMM by the number of rows, as the step compiles it (frozen weights,
Inductor's C++ template, no autotuning: pipelines/compiled.py), in bf16 and float32; with
`--block 4` the rows go through GEMMs of at most 4 rows each.

    python benchmarks/gemm_rows.py --shape 3072 576 --rows 1 2 4 5 8 16 [--block 4]

Why: a step's GEMMs have B x (K + 1) rows. On 2 AMD EPYC Zen 4 cores the template's time per row
rises past 4 rows (SmolLM2's 3072 x 576 MLP GEMM: about 160 us for 1-4 rows, 450-570 us for 8), and
the same rows in 4-row blocks took about half of that in bf16 (README, "Which dtype").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specgen.pipelines.compiled import _take_templates_without_autotuning, _under_settings, own_code


def time_gemm(linear: torch.nn.Linear, rows: int, block: int | None) -> float:
    """Median microseconds of one call of the compiled GEMM of `rows` rows through `linear` (a
    module's parameter, as in the step: only those are frozen and prepacked)."""
    def gemm(x):
        if block is None or rows <= block:
            return linear(x)
        return torch.cat([linear(x[i:i + block]) for i in range(0, rows, block)])

    torch._dynamo.reset()
    fn = _under_settings(torch.compile(own_code(gemm), fullgraph=True, dynamic=False), True, torch.device("cpu"))
    x = torch.randn(rows, linear.in_features, dtype=linear.weight.dtype)
    with torch.no_grad():
        for _ in range(20):
            fn(x)
        samples = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(50):
                fn(x)
            samples.append((time.perf_counter() - start) / 50 * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[3072, 576], metavar=("OUT", "IN"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 5, 8, 16])
    parser.add_argument("--block", type=int, default=None, help="rows per GEMM (default: all in one)")
    args = parser.parse_args()
    _take_templates_without_autotuning()
    for dtype in (torch.bfloat16, torch.float32):
        linear = torch.nn.Linear(args.shape[1], args.shape[0], bias=False).to(dtype).eval()
        for rows in args.rows:
            print(f"{str(dtype).removeprefix('torch.'):8s} {rows:3d} rows x {args.shape[0]} x {args.shape[1]}: "
                  f"{time_gemm(linear, rows, args.block):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
