"""Time of one compiled CPU GEMM by the number of rows, as the step compiles it (frozen weights,
Inductor's C++ template, no autotuning, register tiles of at most 4 rows: pipelines/cpu_gemm.py;
bf16 through the AVX512-BF16 kernel where the CPU has it: kernels/cpu_bf16_dot.py), in bf16 and
float32; with `--tile-rows 0` the tiles Inductor picks itself; with `--no-bf16-dot` Inductor's own
bf16 kernel (bf16 converted to float32); with `--block 4` the rows go through GEMMs of at most 4 rows
each.

    python benchmarks/gemm_rows.py --shape 3072 576 --rows 1 2 4 5 8 16 [--tile-rows 0] [--no-bf16-dot] [--block 4]

Why: a step's GEMMs have B x (K + 1) rows. On 2 AMD EPYC Zen 4 cores, with Inductor's own tiles (8
rows on AVX-512), the template's time per row rose past 4 rows (SmolLM2's 3072 x 576 MLP GEMM in
bf16: 160 us for 4 rows, 571 for 8); with 4-row tiles, 8 rows took 234-241 us (cpu_gemm.py). Run
it with and without `--tile-rows 0` on another CPU before trusting the choice there.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specgen.pipelines.compiled import compile_frozen_on_cpu
from specgen.pipelines.cpu_gemm import MAX_TILE_ROWS, use_cpu_gemm_template


def time_gemm(linear: torch.nn.Linear, rows: int, block: int | None) -> float:
    """Median microseconds of one call of the compiled GEMM of `rows` rows through `linear` (a
    module's parameter, as in the step: only those are frozen and prepacked)."""
    def gemm(x):
        if block is None or rows <= block:
            return linear(x)
        return torch.cat([linear(x[i:i + block]) for i in range(0, rows, block)])

    torch._dynamo.reset()
    fn = compile_frozen_on_cpu(gemm)
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
    parser.add_argument("--tile-rows", type=int, default=MAX_TILE_ROWS,
                        help="most rows of the AVX-512 micro-kernel's register tiles (0: Inductor's own tiles)")
    parser.add_argument("--no-bf16-dot", action="store_true",
                        help="bf16 through Inductor's fp32 micro-kernel, not the AVX512-BF16 one")
    args = parser.parse_args()
    use_cpu_gemm_template(args.tile_rows or None, bf16_dot=not args.no_bf16_dot)
    for dtype in (torch.bfloat16, torch.float32):
        linear = torch.nn.Linear(args.shape[1], args.shape[0], bias=False).to(dtype).eval()
        for rows in args.rows:
            print(f"{str(dtype).removeprefix('torch.'):8s} {rows:3d} rows x {args.shape[0]} x {args.shape[1]}: "
                  f"{time_gemm(linear, rows, args.block):8.1f} us", flush=True)


if __name__ == "__main__":
    main()
