"""Block-FP8 GEMMs against bf16 on DeepSeek-V3's real shapes (kernels/block_fp8.py), for a GPU.

    python benchmarks/fp8_gemm.py [--rows 1 4 16 64 256] [--repeats 50]

For each projection shape of a DeepSeek-V3 layer (N x K, the weight as the checkpoint stores it) and
each number of rows (B x (K + 1) of a step), the median time of: the bf16 GEMM of the dequantised
weight (`torch.mm`), the block-FP8 op as the model calls it (`torch.ops.specgen.block_fp8_linear`:
torch's blockwise scaled_mm where it passes its probe, else the Triton kernel), and the Triton
kernel alone; activation quantisation included, as the model runs it. Also the routed experts'
per-pair product (`block_fp8_pairs`) for 8 experts a token against a bf16 bmm of the gathered
experts (up to 16 tokens: the gathered copies grow with them). Prints one line per case and the relative error against the reference.

On a CPU it runs the PyTorch references on small copies of the shapes (a smoke run, no figures).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specgen.kernels import block_fp8 as bf

# DeepSeek-V3 (hidden 7168, q_lora 1536, kv_lora 512, 128 heads, MLP 18432, experts 2048), N x K
SHAPES = {
    "q_a_proj": (1536, 7168), "q_b_proj": (24576, 1536), "kv_a_proj_with_mqa": (576, 7168),
    "o_proj": (7168, 16384), "dense gate|up": (36864, 7168), "dense down": (7168, 18432),
    "expert gate|up": (4096, 7168), "expert down": (7168, 2048),
}


def weight(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    nb, kb = -(-n // 128), -(-k // 128)
    real = torch.randn(nb * 128, kb * 128, generator=gen) * 0.02
    scale = real.view(nb, 128, kb, 128).abs().amax(dim=(1, 3)) / bf.FP8_MAX
    fp8 = (real.view(nb, 128, kb, 128) / scale[:, None, :, None]).view(nb * 128, kb * 128)[:n, :k].to(bf.FP8)
    return fp8.contiguous().to(device), scale.to(device)


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn()`."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shrink = 1 if cuda else 16           # a CPU smoke run: shapes / 16
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu (smoke run, references only)'}; "
          f"FP8 tensor cores: {bf.fp8_gemm_supported(device)}; blockwise scaled_mm: {bf.scaled_mm_works(device)}")
    for name, (n, k) in SHAPES.items():
        n, k = max(128, n // shrink), max(128, k // shrink)
        w, s = weight(n, k, device)
        dense = bf.dequantize_weight(w, s).to(torch.bfloat16)
        for rows in args.rows:
            x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(1)) * 0.5).to(torch.bfloat16).to(device)
            ref = bf.block_fp8_linear_reference(x, w, s).float()
            got = torch.ops.specgen.block_fp8_linear(x, w, s, 128).float()
            error = ((got - ref).norm() / ref.norm()).item()
            bf16_ms = timed(lambda: torch.mm(x, dense.t()), args.repeats)
            op_ms = timed(lambda: torch.ops.specgen.block_fp8_linear(x, w, s, 128), args.repeats)
            line = f"{name:20s} {n:6d}x{k:<6d} rows {rows:4d}: bf16 {bf16_ms:7.3f} ms, fp8 op {op_ms:7.3f} ms " \
                   f"({bf16_ms / op_ms:4.2f}x), error {error:.1e}"
            if cuda and bf.fp8_gemm_supported(device):
                triton_ms = timed(lambda: bf.block_fp8_linear_triton(x, w, s), args.repeats)
                line += f", triton {triton_ms:7.3f} ms"
            print(line, flush=True)
    # routed experts: each token's 8 experts, as pairs
    n, k = SHAPES["expert gate|up"]
    n, k = max(128, n // shrink), max(128, k // shrink)
    stack = [weight(n, k, device) for _ in range(8)]
    w, s = torch.stack([a for a, _ in stack]), torch.stack([b for _, b in stack])
    dense = torch.stack([bf.dequantize_weight(a, b) for a, b in stack]).to(torch.bfloat16)
    for rows in [r for r in args.rows if r <= 16]:    # gathered bf16 experts: 8 x rows weight copies
        tokens = torch.randn(rows, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(device)
        pairs = tokens.repeat_interleave(8, dim=0)
        experts = torch.arange(8, device=device).repeat(rows)
        ref = bf.block_fp8_pairs_reference(pairs, experts, w, s).float()
        got = torch.ops.specgen.block_fp8_pairs(pairs, experts, w, s, 128).float()
        error = ((got - ref).norm() / ref.norm()).item()
        bf16_ms = timed(lambda: torch.bmm(dense[experts], pairs.unsqueeze(-1)), args.repeats)
        op_ms = timed(lambda: torch.ops.specgen.block_fp8_pairs(pairs, experts, w, s, 128), args.repeats)
        print(f"experts (8 a token)  {n:6d}x{k:<6d} rows {rows:4d}: bf16 gathered {bf16_ms:7.3f} ms, fp8 pairs "
              f"{op_ms:7.3f} ms ({bf16_ms / op_ms:4.2f}x), error {error:.1e}", flush=True)


if __name__ == "__main__":
    main()
