"""`num_speculative_tokens: auto` for drafts made on the host (drafts/suffix.py): verify them, or not.

Contract: before each step the runner asks the proposer for every live slot's proposal, then
`choose_host(proposals, width, available)` -> k, 0 being the plain step (one row per slot). It
reports each step's time with `observe_step(k, width, seconds)`, each slot's verified block with
`observe_block(slot, k, accepted)` and, on plain steps, the tokens committed with
`observe_tokens(slot, tokens)`.

Unlike a draft model's, a host proposal comes with its own estimate: the probability of each of its
prefixes (drafts.suffix.Proposal.probs), so the choice is made per step, for the proposals at hand:

    rate(k) = (live slots + c * sum over slots of the first k probabilities) / cost(k)

- k is 0, or a variant that runs without compiling (compiled: K, the one variant besides the plain
  step, proposals padded to it; eager: any k up to the longest proposal, every row costs there);
- c calibrates the index's estimates against what the target accepts: accepted over predicted,
  over the blocks verified so far and over "shadow" proposals (made at plain steps, compared with
  the tokens those steps then commit, so the job measures its proposals before any is verified),
  starting from CALIBRATION_PRIOR;
- cost(k) is the median of the last COST_WINDOW steps of k, from the warm-up's profile before any
  (`profile`): the plain step timed, K's verify timed eagerly and scaled as the plain step scales
  from eager to compiled (pessimistic: eager time grows with rows faster than compiled time).
  Until COST_SETTLED steps of k are measured, the lower of their median and that prior figure: a
  variant is measured only while it is chosen, so one slow first step (a first call after the
  graph loads, a noisy neighbour) taken at face value would shut it out for the rest of the job
  (seen: a hybrid's host-only step measured once at 356 ms against 32 ms, then never taken again).
  And where the measured cost forbids a k that its prior figure would take, every REMEASURE_FIRST
  such steps (the interval doubling up to REMEASURE_MAX) the step takes k once to measure it again,
  its time starting the variant's window afresh (seen: suffix `auto` measured its first three
  steps of 4 rows at 88 ms, against 31 for the same steps of its pinned-K twin, and ran plain for
  the rest of the job).
A variant that needs compiling (compiled runs: K, until its first use) is compiled when the time it
is expected to save over the rest of the job, at the job's mean gain per step so far, is at least
COMPILE_PAYBACK times its compile time (estimated as the plain step's): a short job never compiles
what it cannot repay, and a job whose text never repeats never compiles it at all.
Nothing here touches a tensor.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence

import torch

from specgen.pipelines.profile import median_seconds

COST_WINDOW = 15
COST_SETTLED = 3                   # steps of a variant measured before their median alone is its cost
CALIBRATION_PRIOR = (4.0, 2.8)     # pseudo (predicted, accepted) tokens: the index's figures at 0.7
GAIN_RATE = 0.05                   # the job's mean gain per step: an EMA over ~20 steps
COMPILE_PAYBACK = 2.0
# Drafting must beat the plain step's rate by MIN_GAIN, plus MARGIN_PER_COST for each plain step's
# worth its step costs more: a step of 2.6x the plain one (8 slots x 4 rows on 2 CPU cores) pays
# only where the estimate beats plain decoding by 19%, since a step chosen for its high estimate
# tends to accept less than estimated (measured: `auto` 0.84x ar at 8 slots with the flat 3%).
MIN_GAIN = 0.03
MARGIN_PER_COST = 0.1
REMEASURE_FIRST = 16               # steps a measured cost forbade k (its prior allowing it) before k runs again
REMEASURE_MAX = 256
VERIFIED_ENOUGH = 20.0             # predicted tokens of verified blocks before c is theirs alone


def margin(cost: float, plain_cost: float) -> float:
    """What a drafted step's rate must beat plain decoding's by, relative (see MIN_GAIN)."""
    return MIN_GAIN + MARGIN_PER_COST * max(0.0, cost / plain_cost - 1)


class HostDraftPolicy:
    def __init__(self, k_max: int, *, horizon_tokens: int | None = None) -> None:
        self.k = self.k_max = k_max
        self.horizon_tokens = horizon_tokens
        self.costs: dict[tuple[int, int], deque] = {}      # (width, k) -> recent step seconds
        self.profiled: dict[tuple[int, int], float] = {}   # (width, k) -> the warm-up's figure
        self.estimated: set[tuple[int, int]] = set()        # profiled figures estimated from eager time
        self.compile_estimate: float | None = None         # seconds to compile K (None: no estimate)
        self.predicted, self.accepted = CALIBRATION_PRIOR
        self.verified = [0.0, 0.0]       # predicted, accepted: the blocks verified (chosen by this rule)
        self.gain = 0.0                  # EMA of c * (the step's summed probabilities) / live slots
        self.committed = 0               # tokens committed so far (to know what the job has left)
        self._offered: dict[int, tuple[float, ...]] = {}   # slot -> probs of its proposal, this step
        self._shadows: dict[int, tuple[tuple[int, ...], tuple[float, ...], int]] = {}
        self.steps = {"plain": 0, "drafted": 0, "remeasured": 0}
        self._missed: dict[tuple[int, int], int] = {}      # (width, k) -> steps its measured cost forbade it
        self._interval: dict[tuple[int, int], int] = {}    # (width, k) -> missed steps before it runs again
        self.remeasure: tuple[int, int] | None = None      # this step runs (width, k) to measure it again

    # -- what the runner asks -----------------------------------------------------------------------

    def choose(self, slots: Sequence, available: set[int] | None = None, width: int | None = None) -> int:
        """The most tokens to ask each slot's proposal for (the runner then calls `choose_host`)."""
        return self.k_max

    def calibration(self) -> float:
        """Accepted over predicted: of the verified blocks alone once there are enough of them (they
        were chosen by this rule, so they carry its selection: a proposal picked for a high estimate
        is the one most likely overestimated), else of every block and shadow so far."""
        predicted, accepted = self.verified
        if predicted >= VERIFIED_ENOUGH:
            prior_predicted, prior_accepted = CALIBRATION_PRIOR
            return (accepted + prior_accepted) / (predicted + prior_predicted)
        return self.accepted / self.predicted

    def choose_host(self, proposals: dict, width: int, available: set[int], compiled: bool) -> int:
        """k for this step: 0, or a k in `available` (or K, where compiling it pays) verifying the
        proposals (`proposals`: slot -> drafts.suffix.Proposal)."""
        n = len(proposals)
        c = self.calibration()
        self.offer(proposals)
        total = sum(p.score for p in proposals.values())
        self.gain += GAIN_RATE * (c * total / max(n, 1) - self.gain)
        longest = max((len(p) for p in proposals.values()), default=0)
        plain_cost = self.cost(0, width)
        plain_rate = n / plain_cost
        best, best_rate = 0, plain_rate

        def wins(rate: float, cost: float) -> bool:
            return rate > plain_rate * (1 + margin(cost, plain_cost)) and rate > best_rate

        candidates = [k for k in (range(1, longest + 1) if not compiled else (self.k_max,))
                      if k in available or (compiled and self._worth_compiling(k, width, n))]
        forbidden = None            # a measured k its prior figure would take
        for k in candidates:
            tokens = n + c * sum(sum(p.probs[:k]) for p in proposals.values())    # expected, all slots
            cost = self.cost(k, width)
            if wins(tokens / cost, cost):
                best, best_rate = k, tokens / cost
            elif (width, k) in self.costs and wins(tokens / (prior := self._prior_cost(k, width)), prior):
                forbidden = k
        self.remeasure = None
        if best and len(self.costs.get((width, best), ())) >= COST_SETTLED:
            # its measured cost lets it win again: a later doubt starts from the first interval
            self._interval.pop((width, best), None)
            self._missed.pop((width, best), None)
        elif not best and forbidden is not None:
            key = (width, forbidden)
            self._missed[key] = self._missed.get(key, 0) + 1
            if self._missed[key] >= self._interval.get(key, REMEASURE_FIRST):
                self._missed[key] = 0
                self._interval[key] = min(2 * self._interval.get(key, REMEASURE_FIRST), REMEASURE_MAX)
                best, self.remeasure = forbidden, key
                self.steps["remeasured"] += 1
        if best == 0:
            self.shadow(proposals)
        else:
            # the slots' texts move on by more than one token: a shadow still matching counts what it
            # matched so far (dropping it uncounted would leave only the refuted ones: c too low)
            for _, probs, matched in self._shadows.values():
                self.predicted += sum(probs[:matched])
                self.accepted += matched
            self._shadows.clear()
        self.steps["drafted" if best else "plain"] += 1
        return best

    def offer(self, proposals: dict) -> None:
        """The proposals this step verifies (set by `choose_host`; a hybrid's, by the slots that took
        them): `observe_block` calibrates on them."""
        self._offered = {b: p.probs for b, p in proposals.items()}

    def shadow(self, proposals: dict) -> None:
        """Proposals this step does not verify: settled against the tokens it commits (`observe_tokens`)."""
        for b, p in proposals.items():
            if len(p) and b not in self._shadows:
                self._shadows[b] = (p.tokens, p.probs, 0)

    def cost(self, k: int, width: int) -> float:
        recent = self.costs.get((width, k))
        if not recent:
            return self._prior_cost(k, width)
        measured = statistics.median(recent)
        return measured if len(recent) >= COST_SETTLED else min(measured, self._prior_cost(k, width))

    def _prior_cost(self, k: int, width: int) -> float:
        """k's cost before its own steps are measured: the warm-up's figures."""
        if (width, k) in self.profiled:
            return self.profiled[(width, k)]
        if 0 < k < self.k_max and (width, 0) in self.profiled and (width, self.k_max) in self.profiled:
            # an eager k between the two profiled: rows cost in proportion
            plain, full = self.cost(0, width), self.cost(self.k_max, width)
            return plain + (full - plain) * k / self.k_max
        # not profiled at this width (a narrowed tail): the nearest known, scaled by rows
        known = [(w, j, s) for (w, j), s in self.profiled.items()] or [(width, 0, 1.0)]
        w, j, seconds = min(known, key=lambda e: (abs(e[0] - width), abs(e[1] - k)))
        return seconds * (width * (k + 1)) / (w * (j + 1)) if (w, j) != (width, k) else seconds

    def _worth_compiling(self, k: int, width: int, n: int) -> bool:
        if self.compile_estimate is None:
            return False
        remaining = (self.horizon_tokens - self.committed) if self.horizon_tokens else self.committed
        plain_per_token = self.cost(0, width) / n
        drafted_per_token = self.cost(k, width) / (n * (1 + self.gain))
        saved = remaining * (plain_per_token - drafted_per_token)
        return saved >= COMPILE_PAYBACK * self.compile_estimate

    # -- what the runner reports --------------------------------------------------------------------

    def planned_cost(self, k: int, width: int) -> float:
        """What `choose_host` priced k at this step: its prior figure for a re-measure."""
        return self._prior_cost(k, width) if self.remeasure == (width, k) else self.cost(k, width)

    def observe_step(self, k: int, width: int, seconds: float) -> None:
        window = self.costs.setdefault((width, k), deque(maxlen=COST_WINDOW))
        if self.remeasure == (width, k):
            window.clear()              # measured again: the earlier figures are what it doubts
            self.remeasure = None
        window.append(seconds)

    def observe_block(self, slot: int, k: int, accepted: int) -> None:
        self.committed += accepted + 1
        probs = self._offered.get(slot, ())
        if k == 0 or not probs:
            return
        own = min(k, len(probs))
        self.predicted += sum(probs[:own])
        self.accepted += min(accepted, own)
        self.verified[0] += sum(probs[:own])
        self.verified[1] += min(accepted, own)

    def observe_tokens(self, slot: int, tokens: Sequence[int]) -> None:
        """Tokens a plain step committed: they settle the slot's shadow proposal, if any."""
        shadow = self._shadows.get(slot)
        if shadow is None:
            return
        proposed, probs, matched = shadow
        for token in tokens:
            if token != proposed[matched]:
                break
            matched += 1
            if matched == len(proposed):
                break
        else:
            self._shadows[slot] = (proposed, probs, matched)
            return
        del self._shadows[slot]
        self.predicted += sum(probs)
        self.accepted += matched

    def admit(self, slot: int) -> None:
        self._shadows.pop(slot, None)

    def move(self, src: int, dst: int) -> None:
        if src in self._shadows:
            self._shadows[dst] = self._shadows.pop(src)

    def summary(self) -> dict:
        return {"policy": "auto", "drafts": "host", "k_max": self.k_max,
                "calibration": round(self.calibration(), 3), "steps": dict(self.steps),
                "compile_estimate_s": round(self.compile_estimate, 1) if self.compile_estimate else None,
                "step_ms": {f"{w}x{k}": round(1e3 * self.cost(k, w), 2) for (w, k) in sorted(self.costs)}}


@torch.inference_mode()
def profile(policy: HostDraftPolicy, functions, kv_len: int, slots: int, cold_compile: float) -> float:
    """Warm-up, every slot inactive: time the plain step (compiled already) and estimate K's step;
    `cold_compile`: what compiling the plain step took from nothing (K's estimate). Seconds spent."""
    start = time.perf_counter()
    unified, device = functions.unified, functions.device
    state, caches, sampling = functions.state, functions.caches, functions.sampling
    state.active.zero_()
    k = policy.k_max
    plain = median_seconds(device, lambda: functions.verify(kv_len, 1))
    policy.profiled[(slots, 0)] = plain
    if functions.verify_ready(k + 1):
        policy.profiled[(slots, k)] = _verify_seconds(functions, kv_len, k)
    else:
        key_index = functions.key_index(kv_len)

        def eager(t: int) -> float:
            rows = torch.arange(t, device=device)
            return median_seconds(device, lambda: unified.verify_block(state, caches, sampling, key_index, rows), 1)

        plain_eager = eager(1)
        policy.profiled[(slots, k)] = eager(k + 1) * min(1.0, plain / plain_eager)
        policy.estimated.add((slots, k))
        policy.compile_estimate = cold_compile
    state.active.zero_()
    return time.perf_counter() - start


@torch.inference_mode()
def refresh(policy: HostDraftPolicy, functions, kv_len: int, slots: int) -> float:
    """Before a run, every slot inactive: time the variants whose warm-up figure was estimated and
    that have been compiled since (by this policy's run, or by a pinned K sharing the runner, as in
    bench): the estimate is pessimistic, and a variant never chosen is never measured (seen: suffix
    `auto` ran plain steps on a verify of 4 rows its pinned-K twin ran at 1.16x ar). Seconds spent."""
    start = time.perf_counter()
    functions.state.active.zero_()          # no slot moves: a verify of inactive slots commits nothing
    for width, k in sorted(policy.estimated):
        if width == slots and functions.verify_ready(k + 1):
            policy.profiled[(width, k)] = _verify_seconds(functions, kv_len, k)
            policy.estimated.discard((width, k))
    return time.perf_counter() - start


def _verify_seconds(functions, kv_len: int, k: int) -> float:
    """Median seconds of the compiled verify of k + 1 rows per slot."""
    return median_seconds(functions.device, lambda: functions.verify(kv_len, k + 1))
