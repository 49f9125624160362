"""A draft model and host proposals side by side (`draft.method: eagle3+suffix`): per step, per slot, the
block expected to accept more.

Contract: the runner asks `choose(slots, available, width)` (the model's policy answers: k for its
draft, 0 = a plain step), then `decide(k, proposals, width, ready, compiled)` with every live slot's
host proposal (drafts.suffix.Proposal, up to K tokens), and gets a `Plan`:
- `k`, and `host_only`: a step of the host's proposals alone (the verify of k + 1 rows; the draft
  does not run and catches up on these positions at its next step), or the model's step of k drafts;
- `use`: the slots whose k draft rows are the host's proposal (padded), not the model's block.
It reports as it does to every policy (`observe_block`, `observe_step`, `observe_tokens`); each part
hears what concerns it: the model's acceptance only from blocks it drafted, the host's calibration
only from proposals verified or settled as shadows, each step time only to the policy whose step it
was.

Per slot, in a model step of k drafts, the host's proposal replaces the model's block where

    c * (the proposal's summed prefix probabilities up to k)  >  the model's expected accepted drafts at k

(c: the host policy's calibration, accepted over predicted; the model's expectation: its per-slot
acceptance over the job's, pipelines/policy.py). The draft runs for every slot either way, so the
choice costs nothing: it only picks the likelier block. With `num_speculative_tokens: auto` the host
may also take a whole step without the draft (its rate against the plain step's, as suffix alone
decides, pipelines/host_policy.py): chosen where its rate beats the model step's, all slots' best
blocks counted, at each variant's measured cost. A model step its policy chose as the best estimate
(not a probe) runs only where its rate, the slots' suffix blocks counted, beats the plain step's by
that margin too (host_policy.margin); else the step is plain (`held_back` in the stats). And where
the model's policy runs a plain step (its draft alone does not pay), a model step that runs without
compiling is taken for the slots' suffix
blocks where its rate with them beats the plain step's by the margin suffix alone asks: its draft
rows are then the price of a variant already compiled. A pinned K runs the model's step of K, or,
where every live slot takes the host's block, the verify of K + 1 rows alone (compiled beside it).
Nothing here touches a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specgen.pipelines.host_policy import HostDraftPolicy, margin
from specgen.pipelines.policy import AdaptivePolicy, FixedPolicy


@dataclass(slots=True)
class Plan:
    k: int
    host_only: bool = False
    use: set[int] = field(default_factory=set)      # slots whose drafts are the host's proposal


class HybridPolicy:
    def __init__(self, model: AdaptivePolicy | FixedPolicy, host: HostDraftPolicy,
                 estimator: AdaptivePolicy | None = None) -> None:
        """`model`: the draft model's policy; `host`: the host proposals' (its calibration, and with
        an adaptive model its step costs); `estimator`: the model's acceptance where `model` keeps
        none (a pinned K)."""
        self.model, self.host = model, host
        self.adaptive = isinstance(model, AdaptivePolicy)
        self._estimator = None if self.adaptive else estimator
        assert self.estimator is not None, "a pinned K needs an acceptance estimator"
        self.k = self.k_max = model.k_max if self.adaptive else model.k
        self.plan = Plan(0)
        self.steps = {"plain": 0, "model": 0, "mixed": 0, "host": 0}   # mixed: some slots took the host's
        self.held_back = 0        # model steps its policy chose that fell short of the margin: plain
        self.blocks = {"model": 0, "host": 0}

    @property
    def estimator(self) -> AdaptivePolicy:
        """The model's acceptance: an adaptive model's policy itself, read through `self.model` so that
        a wrapper put there later (parallel/decisions.py under tensor parallelism) is the same object,
        and each block, admit and move reaches the policy once; a pinned K's estimator otherwise."""
        return self.model if self.adaptive else self._estimator

    # -- what the runner asks -----------------------------------------------------------------------

    def choose(self, slots: Sequence, available: set[int] | None = None, width: int | None = None) -> int:
        return self.model.choose(slots, available, width)

    def keeps_draft_state(self, warm_slots: int) -> bool:
        """Every prompt is absorbed: the model's block and the host's are weighed slot by slot,
        every step (`decide`), and a slot's model block is only worth weighing from a warm draft."""
        return True

    def decide(self, k: int, proposals: dict, width: int, ready: set[int], compiled: bool,
               model_ready: set[int] = frozenset()) -> Plan:
        """This step's plan, given the model policy's k and each live slot's proposal (`ready`: the
        host-only variants that run without compiling, as HostDraftPolicy.choose_host takes them;
        `model_ready`: the model's step variants that do)."""
        host, n = self.host, len(proposals)
        c = host.calibration()
        k_host = host.choose_host(proposals, width, ready, compiled) if self.adaptive else 0

        def model_step(kk: int) -> tuple[Plan, float]:
            """The model's step of kk drafts, each slot taking the better block; its expected drafts
            accepted over all slots."""
            model = self.estimator.expected_accepted(list(proposals), kk)
            suffix = {b: c * sum(p.probs[:kk]) for b, p in proposals.items()}
            use = {b for b, p in proposals.items() if len(p) and suffix[b] > model[b]}
            return Plan(kk, use=use), sum(max(model[b], suffix[b]) for b in proposals)

        plan, expected = model_step(k) if k > 0 else (Plan(0), 0.0)
        if self.adaptive:
            cost = self.model.cost(k, width)
            rate = (n + expected) / cost if cost else 0.0
            plain = self.model.cost(0, width)
            if k > 0 and plain and self.model.reason == "best" and rate <= n / plain * (1 + margin(cost, plain)):
                # the model's policy takes the best estimate at par; beside the host, a drafted step
                # must beat plain decoding by the margin a host step must: a step taken for a high
                # estimate accepts less than estimated, and at par these steps lost (a pinned
                # eagle3+suffix K=3 on held-out ShareGPT: its model-only steps 33.4 tok/s, plain
                # steps 38). Its probes still run: they are how it measures its acceptance.
                plan, k, rate = Plan(0), 0, n / plain
                self.held_back += 1
            options = []
            if k == 0 and plain:
                # the model's policy runs plain steps, which its draft alone cannot beat; a compiled
                # step of its may still pay with the slots' suffix blocks (they ride on its rows)
                for kk in sorted(model_ready):
                    kk_cost = self.model.cost(kk, width)
                    if kk_cost:
                        kk_plan, kk_expected = model_step(kk)
                        if kk_plan.use and (n + kk_expected) / kk_cost > rate * (1 + margin(kk_cost, plain)):
                            options.append(((n + kk_expected) / kk_cost, kk_plan))
            if k_host:
                host_rate = (n + c * sum(sum(p.probs[:k_host]) for p in proposals.values())) / host.planned_cost(k_host, width)
                if host_rate > rate:
                    options.append((host_rate, Plan(k_host, host_only=True)))
            if options:
                plan = max(options, key=lambda option: option[0])[1]
        elif k > 0 and len(plan.use) == n and k in ready:
            # a pinned K where every slot takes the host's block: the draft pass would only be discarded
            plan = Plan(k, host_only=True)
        if plan.host_only:
            plan.use = {b for b, p in proposals.items() if len(p)}
        # the host's calibration learns from the proposals verified, and from the others as shadows
        host.offer({b: p for b, p in proposals.items() if b in plan.use})
        host.shadow({b: p for b, p in proposals.items() if b not in plan.use})
        self.steps["host" if plan.host_only else "plain" if plan.k == 0 else
                   "mixed" if plan.use else "model"] += 1
        self.plan = plan
        return plan

    # -- what the runner reports --------------------------------------------------------------------

    def observe_block(self, slot: int, k: int, accepted: int) -> None:
        plan = self.plan
        if k > 0 and slot in plan.use:
            self.blocks["host"] += 1
            self.host.observe_block(slot, k, accepted)
            self._model_heard(slot, 0, accepted)        # not the model's block: its text moved on
        else:
            self.blocks["model"] += k > 0 and not plan.host_only
            self.host.observe_block(slot, 0, accepted)
            self._model_heard(slot, 0 if plan.host_only else k, accepted)

    def _model_heard(self, slot: int, k: int, accepted: int) -> None:
        self.model.observe_block(slot, k, accepted)
        if self.estimator is not self.model:
            self.estimator.observe_block(slot, k, accepted)

    def observe_step(self, k: int, width: int, seconds: float) -> None:
        if self.plan.host_only:
            self.host.observe_step(k, width, seconds)
            return
        self.model.observe_step(k, width, seconds)
        if k == 0:
            self.host.observe_step(0, width, seconds)

    def observe_tokens(self, slot: int, tokens) -> None:
        self.host.observe_tokens(slot, tokens)

    def admit(self, slot: int) -> None:
        for part in {id(p): p for p in (self.model, self.host, self.estimator)}.values():
            part.admit(slot)

    def move(self, src: int, dst: int) -> None:
        for part in {id(p): p for p in (self.model, self.host, self.estimator)}.values():
            part.move(src, dst)

    def summary(self) -> dict:
        return {**self.model.summary(), "hybrid": {"steps": dict(self.steps), "blocks": dict(self.blocks),
                                                   "held_back": self.held_back,
                                                   "host": self.host.summary()}}
