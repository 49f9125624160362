"""Where a step's time goes: wall time per phase, measured on EAGER steps.

Contract: `UnifiedStep.timer` (None by default) may hold a `PhaseTimer`; the step then calls
`begin()` on entry and `mark(phase)` after each phase ("target": the target forward and its logits;
"verify": sampling, verification and commit; "draft": the next block's proposal), and the prefill
marks "prefill". Time between calls (the runner's own work: reading results, stop strings, refills)
falls to "host". Only eager steps may carry a timer: a mark inside a compiled step would break its
graph, so the split of a compiled configuration is measured on its eager twin (`specgen bench`
labels it so). On CUDA every mark synchronises, which is why timing is opt-in.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        self._last: float | None = None

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def begin(self, is_step: bool = True) -> None:
        now = self._now()
        if self._last is not None:
            self.seconds["host"] += now - self._last
        self._last = now
        self.steps += is_step

    def mark(self, phase: str) -> None:
        now = self._now()
        self.seconds[phase] += now - self._last
        self._last = now

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase, and their total."""
        steps = max(1, self.steps)
        out = {phase: 1000 * s / steps for phase, s in self.seconds.items()}
        out["total"] = sum(out.values())
        return out
