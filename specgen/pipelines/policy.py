"""Choosing K per step: the variant that commits the most tokens per second (DESIGN.md section 7).

Contract: the runner asks `choose(slots)` before every step and gets k in 0..K_max (0 = the plain
step: no draft pass, one row per slot); it reports each slot's verified block with
`observe_block(slot, k, accepted)` and each step's wall time with `observe_step(k, width, seconds)`.
`FixedPolicy(k)` always answers k (a recipe that pins `num_speculative_tokens`).

`AdaptivePolicy` maximises expected committed tokens per second of the live slots:

    rate(k) = sum over live slots b of min(E_b(k), tokens b may still emit) / cost(width, k)
    E_b(k)  = 1 + sum_{i=1..k} prod_{j<=i} a_{b,j}

- a_{b,j}, the acceptance of draft position j given that positions 1..j-1 were accepted, is
  measured online: per slot (it changes with the text: code, lists, prose; a slot's own evidence
  fades over its plain steps, back to the job's) over a prior that is the job's own estimate,
  which itself starts from the draft card's held-out figures (`prior`) and forgets old blocks
  (exponential decay), so both follow the job. A position no step has reached yet
  takes the card's figure scaled by how the job's first position compares with the card's.
- cost(width, k) is the measured wall time of a step that drafted k (its call, the draft and the
  verify of k + 1 rows per slot, and the host's share), profiled at warm-up and refined online (the median
  of its recent steps: one odd step moves nothing). Acceptance alone cannot choose k: on a CPU verifying
  k + 1 rows costs little more than one, while on a GPU at large batch it costs k + 1 times as much.
  Costs are kept at the machine's pace: a shared VM runs the same step 20-40% slower for minutes at a
  time, and a variant last timed in a slow spell would otherwise lose to one timed in a fast spell
  (measured: a demo job's k = 1 estimated at 27 ms against 17 for plain steps, where interleaved
  steps of the same run took 16.3 and 14.9). Every steady step updates `pace` (an EMA of its time
  over its variant's cost), and each variant stores its times divided by the pace they ran at. A
  variant's own cost takes a sample only where its step follows another variant's: through a run of
  one variant, its time and the machine's pace cannot be told apart, and the pace takes it all (the
  warm-up's profile times every variant side by side, so the costs start consistent). So variants
  compare as if timed side by side (a probe is timed beside the steps around it); `cost()` gives
  them back at today's pace.
- The k settled on stays while its rate is within SWITCH_MARGIN of the best: estimates that tie
  within their noise would otherwise swap the choice step by step.
- Variants that do not exist yet (the step of k drafts not compiled)
  cost their compile time: the policy compiles k only when the time it is expected to save over the
  rest of the job (`horizon_tokens`) is at least twice that cost, so a short job never compiles what
  it cannot repay (the warm-up asks the same question of the card's figures). The cost of an
  uncompiled verify is an estimate from eager times, which grow with rows far faster than compiled
  ones (MTP's k = 1 on SmolLM2: 35.8 ms estimated, 22.3 compiled, plain steps 19.9), so a job long
  enough to save four times the compile at the variant's floor (the plain step's verify plus its
  draft) compiles the fewest drafts that could win, as a trial: timed before it is used, and its
  time bounds the floors of larger k.
- While k = 0 wins, nothing measures acceptance: every `probe_interval` plain steps one step drafts
  (the best k > 0 that runs without compiling: probes never compile), which also lets the draft
  catch up on the positions it skipped; the probe drafts the same k once more, a step that is
  timed (the catch-up is not), so the variant's cost stays measured too. A probe that confirms
  k = 0 doubles the interval (up to `max_interval`, which keeps every catch-up
  inside the draft's window); a win resets it. A variant whose cost was only estimated (from eager
  times, before it was compiled) runs as soon as it exists until three of its steps are timed. No
  probe leaves plain steps for a k that could not win even with its first position at an upper
  confidence bound and its cost 20% below the estimate (at the estimate itself once three of its
  steps are timed: at 16 slots a k = 1 step measured at 1.6x a plain one kept being probed every
  32 steps, 6% of the job's time, for a first position that accepted 27%). While some
  k > 0 wins, every `probe_interval` steps one step tries k + 1 or, now and then (more often when it
  comes close), k - 1: the next position stays measured, and so does the cost of the cheaper variant
  (plain decoding's, for k = 1), which otherwise nothing would refresh. A probe up is made only while
  k + 1 could still win: with its next position's acceptance at an upper confidence bound (what
  the job has measured there, plus two standard errors); once the job has seen enough of that
  position to rule it out, no step pays for drafting it. Each probe that leaves the choice where it
  was doubles the interval (up to `max_interval`); a change of choice resets it.
- A compiled k that no probe may try any more (judged on a few steps timed in a slow spell) is
  re-timed after 4x `max_interval` plain steps, then after twice as many each time (up to 32x): a
  catch-up and one timed step where k still could not win at that step's time, else its cost
  starts over from three fresh steps; only once every live slot's draft can catch up within its
  window, and never where it could cost over 2% of the rest of the job. A few steps in all where
  it keeps losing, and no job stays locked out of a draft that pays.
Nothing here touches a tensor: the policy is host-side arithmetic on a few floats per slot.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

# Pseudo-observations behind a prior: the card's figures for the job, the job's for a new slot.
JOB_PRIOR_WEIGHT = 12.0
SLOT_PRIOR_WEIGHT = 6.0
JOB_DECAY = 0.995          # per observed draft position: the job forgets over ~200 blocks
SLOT_DECAY = 0.9           # a slot over ~10 blocks
COST_WINDOW = 15           # a variant's cost: the median of its last 15 steps
PROFILE_WEIGHT = 2         # ... where the warm-up's profile counts as 2 of them
MIN_GAIN = 0.03            # a variant must beat the current best by this much to be compiled
COMPILE_PAYBACK = 2.0      # ... and save this many times its compile time over the horizon
TRIAL_PAYBACK = 4.0        # or save this many times it at its cost's floor (a trial: see worth_compiling)
FIRST_PROBE_INTERVAL = 8
DOWN_PROBE_CLOSE = 0.85    # a cheaper variant within 15% of the best is probed every other probe,
DOWN_PROBE_EVERY = 4       # ... others every 4th
PACE_RATE = 0.1            # the machine's pace: an EMA over the last ~10 steps
PACE_CLAMP = (0.5, 2.0)    # one step moves it by at most this factor of its variant's cost
COST_DOUBT = 0.8           # a probe out of plain steps is made while k would win at 0.8x its cost,
                           # ... until FIRST_TIMINGS of its steps are timed
FIRST_TIMINGS = 3          # an estimated variant, once compiled, is judged on its first 3 timed steps
UCB_SIGMAS = 2.0           # a probe up assumes the next position accepts this many standard errors better
SWITCH_MARGIN = 0.02       # the settled k stays while it is within 2% of the best
RECHECK_INTERVALS = 4      # a compiled k ruled out re-timed after 4x max_interval plain steps,
RECHECK_MAX = 32           # ... doubling each time up to 32x
RECHECK_VALUE = 50         # a recheck costs at most 2% of the time the job still has to run


@dataclass(slots=True)
class SlotView:
    """What the policy needs of one live slot."""

    slot: int
    remaining: int             # tokens it may still emit (max_tokens left)
    unabsorbed: int = 0        # positions its draft has not absorbed yet (after plain steps)
    drafts: bool = True        # False: its draft never read its prompt (`keeps_draft_state`): a draft
                               # step gives it one token, as a plain step does


class FixedPolicy:
    """Always the same k (a pinned `num_speculative_tokens`)."""

    reason = "best"            # a fixed k never probes

    def __init__(self, k: int) -> None:
        self.k = k

    def choose(self, slots: Sequence[SlotView], available: set[int] | None = None,
               width: int | None = None) -> int:
        return self.k

    def admit(self, slot: int) -> None: ...

    def move(self, src: int, dst: int) -> None: ...

    def observe_block(self, slot: int, k: int, accepted: int) -> None: ...

    def observe_step(self, k: int, width: int, seconds: float) -> None: ...

    def keeps_draft_state(self, warm_slots: int) -> bool:
        """A pinned K drafts every step: every prompt is absorbed."""
        return True

    def choose_host(self, proposals: dict, width: int, available: set[int], compiled: bool) -> int:
        """Host drafts (drafts/suffix.py): k wherever a slot has a proposal, else the plain step;
        eager, no more than the longest proposal (every row costs there)."""
        longest = max((len(p) for p in proposals.values()), default=0)
        if longest == 0:
            return 0
        return self.k if compiled else min(self.k, longest)

    def observe_tokens(self, slot: int, tokens) -> None: ...

    def summary(self) -> dict:
        return {"policy": f"fixed k={self.k}"}


@dataclass(slots=True)
class _Acceptance:
    """Decayed counts of attempts and acceptances per draft position."""

    attempts: list[float]
    accepts: list[float]

    @classmethod
    def empty(cls, k_max: int) -> _Acceptance:
        return cls([0.0] * k_max, [0.0] * k_max)

    def add(self, k: int, accepted: int, decay: float) -> None:
        # positions 1..accepted were accepted; position accepted + 1 (if drafted) was rejected
        for j in range(min(accepted + 1, k)):
            self.attempts[j] = self.attempts[j] * decay + 1.0
            self.accepts[j] = self.accepts[j] * decay + (j < accepted)

    def fade(self, decay: float) -> None:
        self.attempts = [n * decay for n in self.attempts]
        self.accepts = [a * decay for a in self.accepts]

    def rates(self, prior: Sequence[float], weight: float) -> list[float]:
        return [(s + weight * p) / (n + weight) for s, n, p in zip(self.accepts, self.attempts, prior)]


class _Cost:
    """A variant's step time: the median of its last COST_WINDOW observed steps. A profiled figure
    counts as PROFILE_WEIGHT observations, so one odd step (the first after a bucket change, a GC
    pause) never replaces it: a mean did, and a plain step measured once at 1.5x its cost kept a
    demo job on k = 1 (52.6 ms estimated for k = 0, ~30 ms true). Samples are not clamped to the
    current figure: that figure may itself be the odd one (a variant's first timed step took 5x its
    next ones, and clamped to it they kept k = 1 at 2.6x its cost for the rest of a bench).
    `timed` counts the steps behind the figure (profiled ones not counted)."""

    __slots__ = ("recent", "timed")

    def __init__(self, seconds: float, profiled: bool) -> None:
        self.recent: deque[float] = deque([seconds] * (PROFILE_WEIGHT if profiled else 1), maxlen=COST_WINDOW)
        self.timed = 0 if profiled else 1

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.timed += 1

    @property
    def samples(self) -> int:
        return len(self.recent)

    @property
    def seconds(self) -> float:
        return statistics.median(self.recent)


@dataclass
class AdaptivePolicy:
    k_max: int
    prior: list[float]                       # card: acceptance of position j given 1..j-1 accepted
    compile_estimate: dict[int, float] = field(default_factory=dict)   # k -> seconds to compile
    horizon_tokens: float | None = None      # tokens the job is still expected to produce
    max_interval: int = 32
    max_window: int | None = None            # positions a draft's catch-up reads at most (None: any)
    _job: _Acceptance = field(init=False)
    _slots: dict[int, _Acceptance] = field(init=False, default_factory=dict)
    _costs: dict[tuple[int, int], _Cost] = field(init=False, default_factory=dict)
    probe_interval: int = field(init=False, default=FIRST_PROBE_INTERVAL)
    _since_probe: int = field(init=False, default=0)
    _since_down: int = field(init=False, default=0)     # probes since the last one that went down
    _produced: float = field(init=False, default=0.0)
    pace: float = field(init=False, default=1.0)         # today's step time / the stored (profiled) scale
    _last_timed: tuple[int, int] | None = field(init=False, default=None)   # (width, k) of the last steady step
    _estimated: dict[tuple[int, int], int] = field(init=False, default_factory=dict)  # (width, k): steps timed
    _floors: dict[tuple[int, int], float] = field(init=False, default_factory=dict)  # (width, k): least cost
    _second_step: int | None = field(init=False, default=None)   # a probe from plain steps, run twice
    _ruled_out: int = field(init=False, default=0)      # plain steps since a probe found no k that could win
    # (width, k) rechecked -> (its cost, the time at or above which it still could not win: stored scale)
    _rechecking: dict[tuple[int, int], tuple[_Cost, float]] = field(init=False, default_factory=dict)
    recheck_after: int = field(init=False, default=0)    # ... after which a compiled k is re-timed
    _probed_from: int | None = field(init=False, default=None)  # the choice at the last probe
    last_choice: int = field(init=False, default=0)
    # the last probe out of plain steps found no k that could win (and none was worth compiling since)
    ruled_out: bool = field(init=False, default=False)
    _available: set[int] = field(init=False, default_factory=set)   # the variants `choose` last had
    settled: int = field(init=False, default=0)          # the last choice made on the estimates (no probe)
    reason: str = field(init=False, default="best")      # best | compile | probe
    last_rates: dict[int, float] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.prior) < self.k_max:      # a card that measured fewer positions: repeat its last
            last = self.prior[-1] if self.prior else 0.5
            self.prior = [*self.prior, *([last] * (self.k_max - len(self.prior)))]
        self.prior = [min(max(p, 0.0), 0.99) for p in self.prior[: self.k_max]]
        self._job = _Acceptance.empty(self.k_max)
        self.recheck_after = RECHECK_INTERVALS * self.max_interval

    # -- what the runner reports -------------------------------------------------------------------

    def admit(self, slot: int) -> None:
        self._slots[slot] = _Acceptance.empty(self.k_max)

    def move(self, src: int, dst: int) -> None:
        """A live slot moved (the runner narrows its steps in a run's tail)."""
        self._slots[dst] = self._slots.pop(src, _Acceptance.empty(self.k_max))

    def observe_block(self, slot: int, k: int, accepted: int) -> None:
        self._produced += accepted + 1
        if k == 0:
            # A plain step measures nothing, but the slot's text moves on: its own evidence fades back
            # to the job's estimate. Kept, a slot that once rejected a few blocks stayed on plain steps
            # until a probe (50 steps at batch 1, where the job's figures said k = 1 paid 8%).
            own = self._slots.get(slot)
            if own is not None:
                own.fade(SLOT_DECAY)
            return
        self._job.add(k, accepted, JOB_DECAY)
        self._slots.setdefault(slot, _Acceptance.empty(self.k_max)).add(k, accepted, SLOT_DECAY)

    def observe_step(self, k: int, width: int, seconds: float) -> None:
        key = (width, k)
        cost = self._costs.get(key)
        if key in self._estimated:
            # a variant only estimated so far: its first timed steps replace the estimate, and it is
            # judged on their median once there are FIRST_TIMINGS of them (one step can be odd)
            timed = self._estimated[key]
            old, bar = self._rechecking.pop(key, (None, 0.0))
            if old is not None and seconds / self.pace >= bar:
                # a recheck whose first step says k still could not win: done (a catch-up and one step)
                old.add(seconds / self.pace)       # (still the variant's cost: a recheck keeps it)
                del self._estimated[key]
                self._ruled_out = 0
                self._last_timed = key
                return
            if timed == 0:
                self._costs[key] = _Cost(seconds / self.pace, profiled=False)
                self._floors.pop(key, None)
            else:
                cost.add(seconds / self.pace)
            if timed + 1 >= FIRST_TIMINGS:
                del self._estimated[key]
                self._ruled_out = 0
            else:
                self._estimated[key] = timed + 1
        elif cost is None:
            self._costs[key] = _Cost(seconds / self.pace, profiled=False)
        else:
            low, high = PACE_CLAMP
            ratio = min(max(seconds / cost.seconds, low), high)     # this step's pace
            # the first step after the profile moves only the pace: the profile timed the variants side
            # by side but at the shortest kv bucket with no slot live, and a 16-slot job's steps
            # then ran 1.5x slower than profiled; taken as a sample, that step made plain steps
            # look 20% dearer against the rest for the whole job
            if self._last_timed is not None and key != self._last_timed:
                cost.add(seconds / self.pace)
            self.pace += PACE_RATE * (ratio - self.pace)
        self._last_timed = key

    def set_cost(self, k: int, width: int, seconds: float, estimated: bool = False,
                 floor: float | None = None) -> None:
        """A profiled (warm-up) or `estimated` cost (from an uncompiled variant's eager time), before
        any step of that variant ran (at today's pace). An estimated variant that can run without
        compiling is tried by the next steps until one is timed (`choose`). `floor`: the least the
        variant can cost (an uncompiled verify of k + 1 rows costs at least the plain step's one),
        which decides a trial compile (`worth_compiling`)."""
        self._costs[(width, k)] = _Cost(seconds / self.pace, profiled=True)
        if estimated:
            self._estimated[(width, k)] = 0
        else:
            self._estimated.pop((width, k), None)
        if floor is not None and estimated:
            self._floors[(width, k)] = min(floor, seconds) / self.pace
        else:
            self._floors.pop((width, k), None)

    # -- estimates ---------------------------------------------------------------------------------

    def job_rates(self) -> list[float]:
        """The job's acceptance per position; unreached positions follow the card, scaled."""
        measured = self._job.rates(self.prior, JOB_PRIOR_WEIGHT)
        scale = measured[0] / self.prior[0] if self.prior[0] > 0 else 1.0
        out = []
        for j, rate in enumerate(measured):
            if self._job.attempts[j] < 1.0 and j > 0:
                rate = min(0.99, self.prior[j] * scale)
            out.append(rate)
        return out

    def cost(self, k: int, width: int) -> float | None:
        """Seconds a step of k drafts over `width` slots takes at the machine's current pace."""
        exact = self._costs.get((width, k))
        if exact is not None:
            return exact.seconds * self.pace
        # Another width (eager steps narrow in a run's tail). What k costs against another variant
        # carries over between widths far better than a time does: at batch 16 a k = 1 step cost 1.5x
        # a plain one, and its time scaled down to 4 slots made it look cheaper than the plain step
        # measured there, so narrowed tails drafted at a loss. So: k's ratio to a variant measured at
        # both widths, times that variant's cost at this one; a time scaled by rows only without one.
        here = {kk: c.seconds for (w, kk), c in self._costs.items() if w == width}
        pairs = [(w, kk) for (w, kk) in self._costs if kk in here and (w, k) in self._costs and w != width]
        if pairs:
            w, ref = min(pairs, key=lambda p: (abs(p[0] - width), p[1] != 0))
            ratio = self._costs[(w, k)].seconds / self._costs[(w, ref)].seconds
            return here[ref] * ratio * self.pace
        same_k = [(w, c.seconds) for (w, kk), c in self._costs.items() if kk == k]
        if same_k:
            w, seconds = min(same_k, key=lambda wc: abs(wc[0] - width))
            return seconds * (0.5 + 0.5 * width / w) * self.pace
        return None

    def remaining_tokens(self) -> float:
        """Tokens the job may still produce (a job of unknown length: as many as it produced so far)."""
        return self.horizon_tokens - self._produced if self.horizon_tokens is not None else self._produced

    def floor(self, k: int, width: int) -> float | None:
        """The least a step of k drafts over `width` slots can cost while it is only estimated."""
        floor = self._floors.get((width, k))
        return floor * self.pace if floor is not None else None

    def optimistic_job_rates(self, position: int) -> list[float]:
        """The job's rates with draft position `position` (0-based) at its upper confidence bound."""
        job = self.job_rates()
        rate, seen = job[position], self._job.attempts[position] + JOB_PRIOR_WEIGHT
        job[position] = min(0.99, rate + UCB_SIGMAS * (rate * (1 - rate) / seen) ** 0.5)
        return job

    def rates(self, slots: Sequence[SlotView], width: int, job: list[float] | None = None,
              floors: bool = False) -> dict[int, float]:
        """Expected committed tokens per second for every k with a cost (`job`: other job rates;
        `floors`: an uncompiled variant at the least it can cost, not at its estimate)."""
        job = job if job is not None else self.job_rates()
        costs = {k: self.cost(k, width) for k in range(self.k_max + 1)}
        if floors:
            # a variant costs at least what a timed one of fewer drafts does (more rows, more drafts):
            # once a trial timed k = 1 at 1.6x a plain step, no larger k is tried on its floor
            timed = [(k, c) for k, c in costs.items() if c is not None and (width, k) not in self._estimated]
            for (w, k), f in self._floors.items():
                if w == width:
                    costs[k] = max([f * self.pace, *(c for kk, c in timed if kk < k)])
        costs = {k: c for k, c in costs.items() if c is not None and c > 0}
        tokens = dict.fromkeys(costs, 0.0)
        for s in slots:         # every step, every slot: E(k) for all k in one pass (host time counts)
            own = self._slots.get(s.slot)
            accept = own.rates(job, SLOT_PRIOR_WEIGHT) if own is not None else job
            cap, expected, run = (max(1, s.remaining) if s.drafts else 1), 1.0, 1.0
            for k in range(self.k_max + 1):
                if k:
                    run *= accept[k - 1]
                    expected += run
                if k in tokens:
                    tokens[k] += min(expected, cap)
        return {k: tokens[k] / costs[k] for k in costs}

    def expected_accepted(self, slots: Sequence[int], k: int) -> dict[int, float]:
        """Drafts of a k-token block each slot is expected to accept: sum_{i<=k} prod_{j<=i} a_{b,j}."""
        job = self.job_rates()
        expected = {}
        for b in slots:
            own = self._slots.get(b)
            accept = own.rates(job, SLOT_PRIOR_WEIGHT) if own is not None else job
            total, run = 0.0, 1.0
            for j in range(min(k, self.k_max)):
                run *= accept[j]
                total += run
            expected[b] = total
        return expected

    # -- the decision -------------------------------------------------------------------------------

    def choose(self, slots: Sequence[SlotView], available: set[int] | None = None,
               width: int | None = None) -> int:
        """k for the next step. `available`: draft variants that run without compiling (k = 0 always
        does); only these are probed."""
        width = width if width is not None else len(slots)
        available = {0} | (available if available is not None else set(range(1, self.k_max + 1)))
        self._available = available
        rates = self.last_rates = self.rates(slots, width)
        ready = {k: r for k, r in rates.items() if k in available}
        best = max(ready, key=ready.get) if ready else 0
        # Hysteresis: two variants within the estimates' noise of each other swap places from step to
        # step on noise, and a step after a swap teaches the costs nothing (a catch-up). Measured: MTP at
        # one slot ran plain on 23-51% of its steps, its rates for k = 0 and 1 tied (58.8 and 58.7
        # tok/s), where a fixed K = 1 ran 4% faster than auto in the same bench.
        if self.settled in ready and ready[self.settled] >= (1 - SWITCH_MARGIN) * ready[best]:
            best = self.settled
        # a variant compiled since its cost was estimated (eager times are a poor guide to compiled
        # ones: a bench's auto never ran k = 1 on an estimate, where k = 1 paid most) runs until
        # FIRST_TIMINGS of its steps are timed (its first step after plain ones catches up and is not)
        untimed = [k for k in ready if k > 0 and (width, k) in self._estimated]
        # a trial is weighed where a probe could be made (a pass over the slots is host time), never
        # while another is still being timed (its time may rule the next one out)
        weigh = bool(self._floors) and not untimed and self._since_probe + 1 >= self.probe_interval
        floor_rates = self.rates(slots, width, floors=True) if weigh else None
        compile = self.worth_compiling(rates, ready, floor_rates)
        if compile is not None:
            # compiled by this step; from the next one it runs until it is timed (`untimed`), and no
            # probe may take this step instead (one had delayed a trial by a probe interval)
            if weigh:
                self._since_probe = 0
            self.last_choice, self.reason, self.ruled_out = compile, "compile", False
            return compile
        choice, self.reason = best, "best"
        if untimed:
            self.last_choice, self.reason, self.ruled_out = max(untimed, key=ready.get), "probe", False
            return self.last_choice
        # A probe out of plain steps catches the draft up on them, so its time is not the variant's
        # cost; the step after it drafts the same k and is timed. Without it, a k whose cost was once
        # timed high (one noisy step) lost to plain steps for the rest of the job: its probes only
        # ever measured acceptance (a bench's auto ran k = 0 on 96% of steps where k = 1 paid 1.27x).
        if self._second_step is not None:
            k, self._second_step = self._second_step, None
            if k in ready:
                self.last_choice, self.reason = k, "probe"
                return k
        self._since_probe += 1
        if self._since_probe >= self.probe_interval:
            probe = self._probe(choice, rates, available, slots, width)
            self._since_probe = 0
            if probe is not None:
                # a probe that changes nothing waits longer next time; a change of choice resets it
                self.probe_interval = (min(2 * self.probe_interval, self.max_interval)
                                       if self._probed_from in (None, choice) else FIRST_PROBE_INTERVAL)
                self._probed_from = choice
                if choice == 0 and (width, probe) not in self._estimated:   # (a recheck times its own)
                    self._second_step = probe
                choice, self.reason = probe, "probe"
        if choice > 0:
            self.ruled_out = False
        if self.reason != "probe":
            if choice > 0 and self.settled == 0:
                self.recheck_after = RECHECK_INTERVALS * self.max_interval
                self._ruled_out = 0
            self.settled = choice
        self.last_choice = choice
        return choice

    def worth_compiling(self, rates: dict[int, float], ready: dict[int, float],
                        floor_rates: dict[int, float] | None = None) -> int | None:
        """The variant to compile now, if any: the best one that beats every `ready` variant's rate
        by MIN_GAIN and saves, over the tokens the job may still produce, COMPILE_PAYBACK times
        its compile time (a job of unknown length: as many tokens as it produced so far). Else a
        trial: the variant whose rate at its cost's floor (`floor_rates`) saves TRIAL_PAYBACK times
        its compile time. An uncompiled verify's estimate scales its eager time, and eager time
        grows with rows far faster than compiled time does (benchmarks/variant_estimates.py, SmolLM2
        at one slot: eager verify 60 ms for one row a slot, 102 for two; compiled 19.9 both; MTP's
        k = 1 estimated at 35.8 ms, floor 22.6, 22.3 once compiled), so a long job whose draft did
        pay would never find out.
        The trial's variant is timed before it is used (FIRST_TIMINGS); at worst the job loses
        its compile, a quarter of what it could have saved."""
        if not ready:
            return None
        remaining = self.remaining_tokens()
        best_rate = max(ready.values())

        def saved(rate: float) -> float:
            return remaining * (1.0 / best_rate - 1.0 / rate) if rate >= best_rate * (1 + MIN_GAIN) else 0.0

        candidates = {k: rate for k, rate in rates.items() if k not in ready}
        worth = [k for k, rate in candidates.items()
                 if saved(rate) >= COMPILE_PAYBACK * self.compile_estimate.get(k, float("inf"))]
        if worth:
            return max(worth, key=lambda k: (candidates[k], -k))
        # the fewest drafts: its floor is the surest (two rows a slot against one), and its time
        # bounds every larger k's floor
        trials = [k for k, rate in (floor_rates or {}).items() if k in candidates
                  and saved(rate) >= TRIAL_PAYBACK * self.compile_estimate.get(k, float("inf"))]
        return min(trials) if trials else None

    def _probe(self, choice: int, rates: dict[int, float], available: set[int],
               slots: Sequence[SlotView], width: int) -> int | None:
        if self.k_max == 0:
            return None
        if choice == 0:
            ks = [k for k in available if k > 0 and self._could_beat_plain(k, slots, width)]
            self.ruled_out = not ks
            if ks:
                self._ruled_out = 0
                return max(ks, key=lambda k: rates.get(k, 0.0))
            return self._recheck(rates, available, slots, width)
        up, down = choice + 1, choice - 1
        can_up = up <= self.k_max and up in available and self._may_win(up, choice, slots, width)
        can_down = down == 0 or down in available
        # down when the cheaper variant is close (a cost error could flip the choice) every other
        # probe, else every DOWN_PROBE_EVERY-th: a winning k pays little for keeping it measured
        close = rates.get(down, 0.0) >= DOWN_PROBE_CLOSE * rates.get(choice, 0.0)
        self._since_down += 1
        if can_down and self._since_down >= (2 if close else DOWN_PROBE_EVERY):
            self._since_down = 0
            return down
        return up if can_up else None

    def _recheck(self, rates: dict[int, float], available: set[int], slots: Sequence[SlotView],
                 width: int) -> int | None:
        """Every `recheck_after` plain steps with every k ruled out, the best compiled k is timed
        afresh: a first timed step at which k still could not beat plain steps (its first position
        at its optimistic acceptance, as for a probe) confirms it; a faster one starts it over, its
        next FIRST_TIMINGS timed steps replacing it. The bar is where k breaks even, not a distance
        from the old cost: a draft that pays 5-15% over plain steps (MTP at one slot) was judged
        10-15% dear on a few steps, and a recheck that confirmed anything within 15% of that kept it
        out of whole jobs (a bench's auto ran plain on 78% of its steps at 0.89x of fixed K = 1's
        speed). Without rechecks a median of a few steps timed in one bad spell ruled k out for the
        rest of the job (MTP on held-out ShareGPT at one slot: k = 1 judged at 29 ms against 17 for
        a plain step, where the same bench's fixed K = 1 ran its steps at 1.06x plain ones, and
        auto ran plain throughout). The interval doubles with every recheck (up to RECHECK_MAX
        times max_interval), so a k that keeps losing costs the job a few steps in total; a k that
        wins resets it. A recheck waits
        until every live slot's draft can catch up within its window (the runner keeps every slot
        within it: before a plain step would leave a draft further behind, the draft absorbs alone,
        runner._issue; a caller that does not would leave positions unread in the draft's cache for
        the rest of the request), and is made only where it costs at most 2% of what the job still
        has to run."""
        ks = [k for k in available if k > 0 and (width, k) in self._costs]
        if not ks or not rates.get(0):
            return None
        self._ruled_out += self.probe_interval
        if self._ruled_out < self.recheck_after:
            return None
        if self.max_window is not None and any(s.unabsorbed > self.max_window for s in slots):
            return None
        k = max(ks, key=lambda k: rates.get(k, 0.0))
        # its cost at worst: a catch-up and FIRST_TIMINGS timed steps, each dearer than a plain one
        # (a 16-slot bench of 256 steps paid 4 steps of twice a plain step's time for a recheck 40
        # steps from its end)
        remaining = self.remaining_tokens()
        extra = (1 + FIRST_TIMINGS) * max(self.cost(k, width) - self.cost(0, width), 0.0)
        if remaining / rates[0] < RECHECK_VALUE * extra:
            return None
        self._ruled_out = 0
        self.recheck_after = min(2 * self.recheck_after, RECHECK_MAX * self.max_interval)
        self._estimated[(width, k)] = 0
        optimistic = self._optimistic_rates(slots, width, 0)
        tokens = optimistic[k] * self.cost(k, width)            # k's expected tokens per step, optimistic
        self._rechecking[(width, k)] = (self._costs[(width, k)], tokens / optimistic[0] / self.pace)
        return k

    def keeps_draft_state(self, warm_slots: int) -> bool:
        """Whether the draft should absorb the prompt of a request admitted now (`warm_slots`: live
        slots whose draft did). Absorbing is the draft's pass over every prompt position in the
        prefill: its share of the prefill's work (EAGLE-3 on SmolLM2: 4.6% of a 1,600-token
        prompt's prefill, AMD EPYC Zen 4), which a job pays for every prompt whether it drafts or
        not. Not once drafting is ruled out (the last probe out of plain steps found no k that could
        win at its optimistic acceptance, nor has any been worth compiling since), except for one
        slot while a compiled k may still be rechecked (`_recheck` measures acceptance there). A
        slot whose draft did not absorb its prompt drafts nothing worth verifying: `rates` gives it
        one token a step whatever k, and the runner reports its blocks as plain steps'. Measured on
        64 questions after a 1,600-token shared prefix, 48 tokens each, 16 slots (docs/choosing-a-draft.md: "Choosing
        K")."""
        if not self.ruled_out:
            return True
        return warm_slots == 0 and any(k > 0 for k in self._available)

    def _optimistic_rates(self, slots: Sequence[SlotView], width: int, position: int) -> dict[int, float]:
        """`rates` with the job's acceptance at `position` taken at its optimistic bound (probes,
        rechecks: what would have to hold for a k to win)."""
        return self.rates(slots, width, self.optimistic_job_rates(position))

    def _could_beat_plain(self, k: int, slots: Sequence[SlotView], width: int) -> bool:
        """Whether k drafts could beat plain steps with the first position at its optimistic
        acceptance and k's cost COST_DOUBT below its estimate until FIRST_TIMINGS of its steps are
        timed (then at the estimate): a probe is what would correct either, and where even that
        loses (8 slots on 2 CPU cores: a k = 1 step cost 2x a plain one), probing only costs (a
        bench's auto spent 5% of its steps on k = 1 there)."""
        optimistic = self._optimistic_rates(slots, width, 0)
        cost = self._costs.get((width, k))
        doubt = COST_DOUBT if cost is None or cost.timed < FIRST_TIMINGS else 1.0
        return optimistic.get(k, 0.0) / doubt > optimistic.get(0, 0.0)

    def _may_win(self, k: int, choice: int, slots: Sequence[SlotView], width: int) -> bool:
        """Whether k drafts beat `choice` with k's last position at its optimistic acceptance."""
        optimistic = self._optimistic_rates(slots, width, k - 1)
        return optimistic.get(k, 0.0) > optimistic.get(choice, 0.0)

    def summary(self) -> dict:
        """The policy's current estimates, for the stats file and the progress line."""
        costs = {}
        for (width, k), c in sorted(self._costs.items()):
            costs.setdefault(str(width), {})[str(k)] = round(1000 * c.seconds * self.pace, 2)
        return {
            "policy": "auto",
            "acceptance_per_position": [round(r, 4) for r in self.job_rates()],
            "card_acceptance_per_position": [round(p, 4) for p in self.prior],
            "step_ms": costs,
            "tokens_per_second": {str(k): round(r, 2) for k, r in sorted(self.last_rates.items())},
            "probe_interval": self.probe_interval,
            "drafting_ruled_out": self.ruled_out,
            "pace": round(self.pace, 3),
        }


def per_position_prior(acceptance_lengths: dict[int, float]) -> list[float]:
    """A card's mean acceptance length at some K -> the acceptance of position j given 1..j-1.

    With L(K) = 1 + sum_{i<=K} prod_{j<=i} a_j: between two measured K (and from L(0) = 1 to the
    first), L grows by run * (r + r^2 + ... + r^n) where run is prod a_j up to the lower K, n the
    positions between and r their common rate; each such gap is solved for r. For consecutive K
    that is a_i = (L(i) - L(i-1)) / (L(i-1) - L(i-2)). A card measured only at K = 3, 5, 7 (the
    DFlash one) once gave no prior at all, and the job started from a neutral 0.5 per position
    where its draft accepted 9%. Positions past the last measured K get none (the caller fills)."""
    out, run, done = [], 1.0, 0
    lengths = {0: 1.0, **{k: v for k, v in acceptance_lengths.items() if k >= 1}}
    for k in sorted(lengths)[1:]:
        n, gain = k - done, max(lengths[k] - lengths[done], 0.0)
        rate = _common_rate(gain / run, n) if run > 1e-9 else 0.0
        out.extend([rate] * n)
        run *= rate ** n
        done = k
    return out


def _common_rate(target: float, n: int) -> float:
    """r in [0, 0.99] with r + r^2 + ... + r^n = target (bisection: the sum grows with r)."""
    low, high = 0.0, 0.99
    if sum(high ** i for i in range(1, n + 1)) <= target:
        return high
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid ** i for i in range(1, n + 1)) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2
