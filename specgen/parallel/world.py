"""Which process of a `torchrun` job this is, and the process groups it talks through.

Contract: `World.from_env()` reads the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE); a plain `specgen run` is `World()` (rank 0 of 1) and never touches
torch.distributed. `world.start(device, tensor_parallel)` joins the job's default process group (gloo
on CPU; on CUDA nccl for tensors and gloo for host objects, one group) and makes `world.host_group`,
a gloo group of its own for the host's bookkeeping (progress, the final figures), so that
bookkeeping never queues behind a step's collectives. With `tensor_parallel` N > 1, consecutive
blocks of N ranks each hold one copy of the target split N ways (`world.tp`: the block's group for
the step's collectives; `world.tp_host_group`: a gloo group for the block's host decisions), and
the blocks share out the prompts (`dp_rank` of `dp_size`); only a block's first rank writes
(`writes`). `world.stop()` leaves. `world.from_leader(value)` is rank 0's value everywhere. `world.cpu_share()` is the CPUs this rank may use
when several ranks share one machine's cores, and pins the rank to them. `leave_process(code)` ends a
rank that joined a group, once everything it writes is written, without finalizing the interpreter
(see there why: a rank could abort after a complete job).

specgen runs on torch.distributed as launched by torchrun, never on its own cluster code
(DESIGN.md, section 6): the rendezvous, the store, the restarts and the teardown of every
rank when one dies are torchrun's.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from specgen.models.tensor_parallel import TensorParallel

# The host group's collectives run every few seconds on every rank once the job starts, so none waits
# long; the first may wait for the slowest rank's imports and set-up.
HOST_GROUP_TIMEOUT = timedelta(hours=1)


@dataclass(slots=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    host_group: object | None = field(default=None, repr=False)
    tp: TensorParallel = field(default_factory=TensorParallel)
    tp_host_group: object | None = field(default=None, repr=False)
    _joined: bool = field(default=False, repr=False)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> World:
        """torchrun's variables; rank 0 of 1 outside torchrun. Inconsistent values are a ValueError."""
        env = os.environ if env is None else env
        size = int(env.get("WORLD_SIZE", "1") or 1)
        if size <= 1:
            return cls()
        rank = int(env["RANK"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_size = int(env.get("LOCAL_WORLD_SIZE", size))
        if not (0 <= rank < size and 0 <= local_rank < local_size <= size):
            raise ValueError(f"torchrun environment: RANK {rank}, WORLD_SIZE {size}, LOCAL_RANK {local_rank}, "
                             f"LOCAL_WORLD_SIZE {local_size} do not fit together")
        return cls(rank, size, local_rank, local_size)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: it shows the progress, merges the parts and writes the statistics."""
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        """Copies of the target (blocks of `tp.size` ranks), each taking its share of the prompts."""
        return self.size // self.tp.size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp.size

    @property
    def writes(self) -> bool:
        """The first rank of its copy: the one that writes the copy's results."""
        return self.tp.rank == 0

    def check_tensor_parallel(self, size: int) -> None:
        """A ValueError naming the recipe field unless `size` ranks can hold one copy of the target."""
        if size > 1 and self.size % size:
            where = (f"torchrun started {self.size} processes" if self.distributed else
                     "this is one process; start it with `torchrun --nproc-per-node "
                     f"{size} -m specgen run ...`")
            raise ValueError(f"recipe.runtime.tensor_parallel_size: {size} ranks hold one copy of the target, "
                             f"so the number of processes must be a multiple of it ({where})")

    def start(self, device: torch.device, tensor_parallel: int = 1, expert_parallel: bool = False) -> None:
        """Join the job's process group (once; a no-op for one process) and form the tensor-parallel
        blocks. On CUDA this rank takes the GPU its LOCAL_RANK names."""
        self.check_tensor_parallel(tensor_parallel)
        if not self.distributed or self._joined:
            return
        import torch.distributed as dist

        if device.type == "cuda":
            torch.cuda.set_device(self.local_rank)
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, timeout=HOST_GROUP_TIMEOUT)
        self.host_group = dist.new_group(backend="gloo", timeout=HOST_GROUP_TIMEOUT)
        if tensor_parallel > 1:
            # every rank creates every block's groups, in the same order (new_group is collective)
            for first in range(0, self.size, tensor_parallel):
                ranks = list(range(first, first + tensor_parallel))
                group = dist.new_group(ranks, timeout=HOST_GROUP_TIMEOUT)
                host = dist.new_group(ranks, backend="gloo", timeout=HOST_GROUP_TIMEOUT)
                if self.rank in ranks:
                    self.tp = TensorParallel(self.rank - first, tensor_parallel, group, expert_parallel)
                    self.tp_host_group = host
        self._joined = True

    def stop(self, clean: bool = True) -> None:
        """Leave the process group. `clean`: every rank finished its part (then they meet first);
        after an error only this rank is here, and its peers' collectives would never match a barrier."""
        if not self._joined:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            if clean:
                # every rank here before any tears its groups down: a rank that destroyed them while
                # a peer's last collective was still in gloo's hands made that peer abort at exit
                # ("terminate called without an active exception", tensor parallel with FP8 kept)
                dist.barrier(group=self.host_group)
            dist.destroy_process_group()
        self.host_group = self.tp_host_group = None
        self.tp = TensorParallel()
        self._joined = False

    def from_tp_leader(self, value):
        """The first rank of this copy's `value` on every rank of the copy (collective within it)."""
        if not self.tp.active:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=self.rank - self.tp.rank, group=self.tp_host_group)
        return box[0]

    def from_leader(self, value):
        """Rank 0's `value` on every rank (a collective: every rank calls it); `value` alone."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def cpu_share(self) -> tuple[int, str] | None:
        """(threads, why) for this rank when several ranks run on this machine, pinning it to its own
        share of the CPUs; None for a rank alone on its machine. Ranks that a launcher already pinned
        apart (taskset, numactl: their CPU sets differ) keep their sets; ranks that share one set
        split it in LOCAL_RANK order. Collective over the host group: every rank calls it once, after
        `start`. Why pin: each rank's compiled steps are many short parallel regions whose threads
        spin-wait for each other, and two ranks' threads taking turns on one core stall both
        (machine.py)."""
        if not self.distributed or not hasattr(os, "sched_getaffinity"):
            return None
        import socket

        import torch.distributed as dist

        cpus = sorted(os.sched_getaffinity(0))
        everyone: list = [None] * self.size     # every rank gathers, whatever its machine holds
        dist.all_gather_object(everyone, (socket.gethostname(), cpus), group=self.host_group)
        if self.local_size <= 1:
            return None
        here = [theirs for host, theirs in everyone if host == socket.gethostname()]
        if any(theirs != cpus for theirs in here):
            return len(cpus), f"the {len(cpus)} CPUs this rank was pinned to"
        share = max(1, len(cpus) // self.local_size)
        first = (self.local_rank * share) % len(cpus)
        mine = cpus[first:first + share]
        os.sched_setaffinity(0, mine)
        return share, f"{share} of {len(cpus)} CPUs, a share for each of {self.local_size} ranks here, pinned"


def leave_process(code: int) -> None:
    """End this process now with `code`, without finalizing the interpreter (stdout and stderr
    flushed; every file the job wrote is closed by then). For a torchrun rank that joined a process
    group. Why: torch keeps a gloo group's worker threads after `destroy_process_group` (references
    inside torch.distributed keep the group, so its destructor, which joins them, never runs), and
    a worker drops its last collective's work when its loop comes round: a barrier's work holds the
    works queued before it, and those the tensors they reduced. On a loaded machine that can come
    after the main thread has begun finalizing; freeing a tensor whose Python object it owns takes
    the GIL, Python ends such a thread with pthread_exit, and unwinding through gloo's loop calls
    std::terminate: the rank dies of SIGABRT ("terminate called without an active exception") after
    its results were written, and torchrun calls the job failed. Seen in tests under load (2 runs of
    15); the core's stack: ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> ~AsyncAllreduceWork ->
    TensorImpl::decref_pyobject -> take_gil -> pthread_exit, the main thread in Py_FinalizeEx.
    Upstream: pytorch/pytorch#179291 (an exit hook for this, abandoned)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
