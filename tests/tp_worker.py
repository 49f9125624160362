"""A tensor-parallel rank for tests/test_tensor_parallel.py, started by torchrun (spawned ranks).

`tp_worker.py CHECKPOINT OUT_FOLDER [single | ep]`: every rank loads its slice of the target (with
`ep`, whole routed experts per rank), runs one prefill and one decode step of 3 tokens per row over
a fixed batch, and writes the float32 logits it computed to OUT_FOLDER/rank-<r>.pt (every rank holds
the whole logits: they must all agree); `single` runs the whole target in this one process instead.
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
    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    config = read_config(folder)
    mode = sys.argv[3] if len(sys.argv) > 3 else "tp"
    if mode == "single":
        model = load_target(config, folder, dtype=torch.float32, device="cpu", dummy=False)
        torch.save(forward_twice(model, model.vocab_size), out / "single.pt")
        return
    dist.init_process_group("gloo")
    tp = TensorParallel(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, expert_parallel=mode == "ep")
    model = load_target(config, folder, dtype=torch.float32, device="cpu", dummy=False, tp=tp)
    torch.save(forward_twice(model, model.vocab_size), out / f"rank-{tp.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
