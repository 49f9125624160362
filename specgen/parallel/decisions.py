"""One decision per step for every rank of a tensor-parallel copy of the target.

Contract: `SharedDecisions(policy, world)` stands in for a runner's policy (pipelines/policy.py,
host_policy.py, hybrid_policy.py; `inner` is the policy). Its deciding calls (`choose`: k;
`choose_host`: k for host drafts; `decide`: a hybrid's plan; `worth_compiling`: the variant the
warm-up compiles and times; `keeps_draft_state`: whether the draft absorbs a new prompt) return the copy's first rank's answer on every rank of the copy,
sent over the copy's gloo host group (a few bytes, on the host, before the step is issued); every
other call goes to the rank's own policy unchanged. Why: the ranks of a copy run one step together,
and each collective in it must see the same shapes on every rank, so they must draft the same k;
the policy chooses from measured step times, which differ between ranks by noise. Everything else
a step depends on (acceptance, the tokens, the requests' order) is the same on every rank already:
the ranks verify identical logits with identical keyed noise.
"""

from __future__ import annotations

from specgen.parallel.world import World


class SharedDecisions:
    def __init__(self, policy, world: World) -> None:
        self._policy = policy
        self._world = world

    @property
    def inner(self):
        return self._policy

    def worth_compiling(self, *args, **kwargs):
        return self._world.from_tp_leader(self._policy.worth_compiling(*args, **kwargs))

    def choose(self, *args, **kwargs):
        return self._world.from_tp_leader(self._policy.choose(*args, **kwargs))

    def choose_host(self, *args, **kwargs):
        return self._world.from_tp_leader(self._policy.choose_host(*args, **kwargs))

    def decide(self, *args, **kwargs):
        return self._world.from_tp_leader(self._policy.decide(*args, **kwargs))

    def keeps_draft_state(self, *args, **kwargs):
        # the draft runs whole on every rank: its state, and so its drafts, must be the same on all
        return self._world.from_tp_leader(self._policy.keeps_draft_state(*args, **kwargs))

    def __getattr__(self, name: str):
        return getattr(self._policy, name)
