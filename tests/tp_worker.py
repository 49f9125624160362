"""A tensor-parallel rank for tests/test_tensor_parallel.py, started by torchrun (spawned ranks).

`tp_worker.py CHECKPOINT OUT_FOLDER MODES`: MODES is a comma-separated list of `tp`, `ep` (whole
routed experts per rank), each optionally `+fp8` (block-FP8 weights kept as FP8) or `+int4` (packed
INT4 routed experts kept packed). For each, every
rank loads its slice of the target, runs one prefill and one decode step of 3 tokens per row over a
fixed batch, and writes the float32 logits it computed to OUT_FOLDER/<mode>-rank-<r>.pt (every rank
holds the whole logits: they must all agree). Without torchrun (`single`, `single+fp8`) it runs the
whole target in this one process and writes OUT_FOLDER/<mode>.pt (`single+fp8`, `single+int4`). One process serves every mode: the
imports and the process group are paid once.

`tp_worker.py oracle-job RECIPE PROMPTS OUTPUT PLAIN`: this rank's part of `specgen run RECIPE` (the
library call), its draft's picks replaced by the tokens of PLAIN (a plain run's results) spoiled at
chosen positions (test_oracle_drafts.OracleProposals), so blocks are accepted; it writes the k of
every step this rank ran to OUTPUT.k-rank-<rank>.json. Its step costs are fixed, not this machine's
(a loaded machine's timings could rightly rule drafting out): on the first rank drafting pays, on the
others it does not, so a rank that chose k by itself would part from the first.
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
from specgen.parallel.world import leave_process


def forward_twice(model, vocab: int) -> torch.Tensor:
    """Logits [B, 8 + 3, V] of a prefill of 8 tokens per row, then 3 more tokens per row."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, 11), generator=gen)
    positions = torch.arange(11).repeat(2, 1)
    cache = model.new_cache(2, 32, torch.float32, "cpu")
    first, _ = logits(model, tokens[:, :8], positions[:, :8], cache, 32)
    second, _ = logits(model, tokens[:, 8:], positions[:, 8:], cache, 32)
    return torch.cat((first, second), dim=1)


def oracle_job(recipe: str, prompts: str, output: str, plain: str) -> None:
    import json

    import specgen.job.build as build
    import specgen.job.run as job
    from specgen.parallel.world import World
    from specgen.pipelines.policy import AdaptivePolicy
    from specgen.pipelines.runner import Runner
    from specgen.recipe import load_recipe
    from test_oracle_drafts import OracleProposals

    answers = {r["id"]: r["token_ids"] for r in map(json.loads, Path(plain).read_text().splitlines())}
    references: dict[tuple, list[int]] = {}     # prompt[1:] -> prompt + plain output (OracleProposals)
    requests, load_draft, issue = job.job_requests, build.load_draft, Runner._issue
    ks: list[int] = []

    def known_requests(*args):      # each request's reference, before the runner admits it
        for request in requests(*args):
            references[tuple(request.prompt_ids[1:])] = request.prompt_ids + answers[request.id]
            yield request

    def oracle_draft(*args, device, **kwargs):
        draft = load_draft(*args, device=device, **kwargs)
        return draft if str(device) == "meta" else OracleProposals(draft, references)

    def logged_issue(self, *args):
        k, timed = issue(self, *args)
        ks.append(k)
        return k, timed

    world = World.from_env()
    per_draft = 0.0004 if world.rank == 0 else 0.010          # a drafted row: 4% or 100% of a plain step
    AdaptivePolicy.cost = lambda self, k, width: 0.010 + per_draft * k
    job.job_requests, build.load_draft, Runner._issue = known_requests, oracle_draft, logged_issue
    job.run_job(load_recipe(recipe), prompts=prompts, output=output, world=world)
    Path(f"{output}.k-rank-{world.rank}.json").write_text(json.dumps(ks))


def main() -> None:
    if sys.argv[1] == "oracle-job":
        return oracle_job(*sys.argv[2:])
    folder, out, modes = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3].split(",")
    torch.set_num_threads(1)
    config = read_config(folder)
    distributed = not modes[0].startswith("single")
    if distributed:
        dist.init_process_group("gloo")
    for mode in modes:
        split, _, kept = mode.partition("+")
        keep = {"keep_fp8": kept == "fp8", "keep_int4": kept == "int4"}
        if not distributed:
            model = load_target(config, folder, dtype=torch.float32, device="cpu", dummy=False, **keep)
            torch.save(forward_twice(model, model.vocab_size), out / f"{mode}.pt")
            continue
        tp = TensorParallel(dist.get_rank(), dist.get_world_size(), dist.group.WORLD, expert_parallel=split == "ep")
        model = load_target(config, folder, dtype=torch.float32, device="cpu", dummy=False, tp=tp, **keep)
        torch.save(forward_twice(model, model.vocab_size), out / f"{mode}-rank-{tp.rank}.pt")
    if distributed:
        dist.barrier()      # as World.stop does: no rank tears the group down under a peer's collective
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # as `specgen run` does under torchrun: a rank that joined a group leaves without finalizing
    # (a gloo worker freeing its last collective's tensors then would abort it after its results)
    leave_process(0)
