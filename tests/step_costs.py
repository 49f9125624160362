"""Step costs a test fixes, so `auto`'s choices do not follow this machine's timings.

A test that asserts what `auto` chooses on a real run (it drafts, it verifies forced tokens) would
otherwise fail on a loaded machine, where a drafted step's measured time can rightly rule drafting
out. `pin_host_step_costs` fixes the host-draft policy's (suffix, jump-forward: pipelines/host_policy.py)
costs: a drafted step 1% dearer than a plain one, which any likely proposal repays.
"""

from __future__ import annotations

from specgen.pipelines.host_policy import HostDraftPolicy


def pin_host_step_costs(monkeypatch, plain: float = 0.010) -> None:
    monkeypatch.setattr(HostDraftPolicy, "cost", lambda self, k, width: plain * (1 + 0.01 * k / self.k_max))
