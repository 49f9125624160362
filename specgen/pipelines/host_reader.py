"""Reading each step's output from the device: one read per step, overlapped with the next on CUDA.

Contract: `HostReader(device, shape, depth)`; `reader.start(out)` begins copying a step's output
`out` ([rows, cols] int64, at most `shape`) to the host and returns the function that finishes the
read (a list of rows). On CUDA the copy goes through a ring of `depth` pinned buffers and an event,
so the host can issue the next step before it reads this one; on CPU it is a plain read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class HostReader:
    """Device->host reads of step outputs: through pinned buffers and events on CUDA (a ring, one
    buffer per step in flight), a plain read on CPU. `shape` is the widest output (K drafts); a step
    of k < K drafts (auto's plain and shorter steps) is narrower, and is staged in the first
    rows x cols elements of a buffer, a contiguous view: a copy into a strided view of pinned memory
    (the top-left corner of a [B, K] buffer) would go through pageable memory and block the host,
    so the lagged loop would stop overlapping (GPU_NOTES 3). `ring=True` on CPU runs the CUDA path's
    buffer logic with plain buffers (tests)."""

    def __init__(self, device: torch.device, shape: tuple[int, int], depth: int,
                 ring: bool | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.ring = self.cuda if ring is None else ring
        if self.ring:
            self.buffers = [torch.empty(shape[0] * shape[1], dtype=torch.long, pin_memory=self.cuda)
                            for _ in range(depth)]
            self.events = [torch.cuda.Event() if self.cuda else None for _ in range(depth)]
        self.turn = 0

    def start(self, out: torch.Tensor) -> Callable[[], list[list[int]]]:
        if not self.ring:
            return lambda: out.tolist()
        i = self.turn = (self.turn + 1) % len(self.buffers)
        buffer = self.staging(i, out.shape[0], out.shape[1])
        buffer.copy_(out, non_blocking=self.cuda)
        event = self.events[i]
        if event is not None:
            event.record()

        def read() -> list[list[int]]:
            if event is not None:
                event.synchronize()
            return buffer.tolist()

        return read

    def staging(self, i: int, rows: int, cols: int) -> torch.Tensor:
        """Buffer i's first rows x cols elements as a contiguous [rows, cols] tensor."""
        return self.buffers[i][: rows * cols].view(rows, cols)

