"""A tensor-parallel rank for tests/test_tensor_parallel.py, started by torchrun (spawned ranks).

`tp_worker.py CHECKPOINT OUT_FOLDER MODES`: MODES is a comma-separated list of `tp`, `ep` (whole
routed experts per rank), each optionally `+fp8` (block-FP8 weights kept as FP8). For each, every
rank loads its slice of the target, runs one prefill and one decode step of 3 tokens per row over a
fixed batch, and writes the float32 logits it computed to OUT_FOLDER/<mode>-rank-<r>.pt (every rank
holds the whole logits: they must all agree). Without torchrun (`single`, `single+fp8`) it runs the
whole target in this one process and writes OUT_FOLDER/<mode>.pt. One process serves every mode: the
imports and the process group are paid once.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from model_calls import logits

from specgen.checkpoints.loading import load_target
from specgen.checkpoints.store import read_config
from specgen.models.tensor_parallel import TensorParallel


def forward_twice(model, vocab: int) -> torch.Tensor:
    """Logits [B, 8 + 3, V] of a prefill of 8 tokens per row, then 3 more tokens per row."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, 11), generator=gen)
    positions = torch.arange(11).repeat(2, 1)
    cache = model.new_cache(2, 32, torch.float32, "cpu")
    first, _ = logits(model, tokens[:, :8], positions[:, :8], cache, 32)
    second, _ = logits(model, tokens[:, 8:], positions[:, 8:], cache, 32)
    return torch.cat((first, second), dim=1)


def main() -> None:
    folder, out, modes = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
    torch.set_num_threads(1)
    config = read_config(folder)
    distributed = not modes[0].startswith("single")
    if distributed:
        dist.init_process_group("gloo")
    for mode in modes:
        split, _, fp8 = mode.partition("+")
        keep = fp8 == "fp8"
        if not distributed:
            model = load_target(config, folder, dtype=torch.float32, device="cpu", dummy=False, keep_fp8=keep)
            torch.save(forward_twice(model, model.vocab_size), out / f"{mode}.pt")
            continue
        tp = TensorParallel(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, expert_parallel=split == "ep")
        model = load_target(config, folder, dtype=torch.float32, device="cpu", dummy=False, tp=tp, keep_fp8=keep)
        torch.save(forward_twice(model, model.vocab_size), out / f"{mode}-rank-{tp.rank}.pt")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
