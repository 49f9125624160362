"""Every rank's progress, summed for rank 0's bar, and every rank's final figures, off the step.

Contract: `JobProgress(world)` starts a thread on every rank that, every `interval` seconds, gathers
each rank's latest progress over the world's gloo host group (`all_gather_object`, a few hundred
bytes). The main thread only hands it numbers (`update`) and reads sums (`combined`): nothing here
is ever inside a step, and no step waits for another rank. A rank whose prompts are done calls
`finish(figures)` and keeps taking part; `wait_all()` returns every rank's figures (rank order) once
all have finished. The thread lets the host group's collectives run at the same pace on every rank
whatever each rank's loop is doing: collectives from the generation loops themselves would need
every rank to reach them equally often, which ranks with different prompts never do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from specgen.parallel.world import World
from specgen.pipelines.requests import Progress
from specgen.pipelines.stats import SpecCounters

# Seconds between two gathers: often enough for a live bar, rare enough to cost nothing.
GATHER_INTERVAL = 2.0


class JobProgress:
    def __init__(self, world: World, interval: float = GATHER_INTERVAL) -> None:
        self.world = world
        self.interval = interval
        self._lock = threading.Lock()
        self._mine = _snapshot(None)
        self._others: list[dict] = []          # the other ranks' latest snapshots
        self._figures: list[dict] | None = None
        self._all_done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._gather_loop, name="specgen-job-progress", daemon=True)
        self._thread.start()

    def update(self, p: Progress) -> None:
        with self._lock:
            self._mine = _snapshot(p) | {"figures": self._mine.get("figures")}

    def finish(self, figures: dict) -> None:
        with self._lock:
            self._mine = dict(self._mine, figures=figures)

    def combined(self, p: Progress) -> Progress:
        """`p` (this rank's progress now) plus the other ranks' latest."""
        with self._lock:
            others = list(self._others)
        totals = SpecCounters(p.totals.num_speculative_tokens)
        totals.merge(p.totals)
        finished, tokens, elapsed = p.finished, p.output_tokens, p.elapsed
        for other in others:
            finished += other["finished"]
            tokens += other["output_tokens"]
            elapsed = max(elapsed, other["elapsed"])
            if other["spec"] is not None:
                totals.merge(SpecCounters.from_dict(other["spec"]))
        return Progress(finished, tokens, elapsed, totals)

    def wait_all(self, on_wait: Callable[[], None] | None = None) -> list[dict]:
        """Every rank's figures, once every rank has finished; `on_wait` is called while it waits."""
        while not self._all_done.wait(self.interval / 2):
            if self._error is not None:
                raise RuntimeError(f"rank {self.world.rank}: gathering the ranks' progress failed: "
                                   f"{self._error}") from self._error
            if on_wait is not None:
                on_wait()
        assert self._figures is not None
        return self._figures

    def _gather_loop(self) -> None:
        import torch.distributed as dist

        try:
            while True:
                with self._lock:
                    mine = dict(self._mine)
                everyone: list = [None] * self.world.size
                dist.all_gather_object(everyone, mine, group=self.world.host_group)
                with self._lock:
                    self._others = [s for r, s in enumerate(everyone) if r != self.world.rank]
                if all(s["figures"] is not None for s in everyone):
                    self._figures = [s["figures"] for s in everyone]
                    self._all_done.set()
                    return
                time.sleep(self.interval)
        except BaseException as err:   # surfaces in wait_all on the main thread
            self._error = err


def _snapshot(p: Progress | None) -> dict:
    if p is None:
        return {"finished": 0, "output_tokens": 0, "elapsed": 0.0, "spec": None, "figures": None}
    return {"finished": p.finished, "output_tokens": p.output_tokens, "elapsed": p.elapsed,
            "spec": p.totals.to_dict(), "figures": None}
