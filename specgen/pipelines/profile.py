"""Warm-up profiling for the adaptive policy: what every variant of the step costs, before any request.

Contract: `calibrate(policy, functions, kv_len, slots)` runs with every slot inactive (nothing
advances; every write lands in scratch entries) and:
- times the plain step (the verify of one row per slot, compiled first if it is not yet) and every
  variant k that runs without compiling (its draft and the verify of k + 1 rows, one call; when
  steps run eagerly, k = 1 and K_max, the others interpolated: `eager_costs`);
- for the variants that would need compiling, estimates their compiled time (the eager time of
  their draft and verify, scaled by the plain step's compiled/eager ratio) and their compile time
  (the verify: what the plain step's took, or would have taken from nothing where it came from
  Inductor's graph cache; the draft: that, scaled by how much smaller its work is);
- gives the policy `cost(k)`, the step's time, for every k (and, where it is only estimated, its
  floor `verify(1) + draft(k)`), and compiles now the variant
  that the card's acceptance says the job repays (`AdaptivePolicy.worth_compiling`: the time it is
  expected to save over the job's tokens at least twice its compile time, or, as a trial, four
  times at its floor), then times it (its profiled time replaces the estimate).
Returns the seconds spent. Step times keep being refined by the policy during the run.
"""

from __future__ import annotations

import statistics
import time

import torch

from specgen.pipelines.compile_clock import slowest_lowering
from specgen.pipelines.compiled import StepFunctions
from specgen.pipelines.policy import AdaptivePolicy, SlotView

REPEATS = 3
MIN_COMPILE_SECONDS = 5.0
# A step lowered and built from nothing against the same step loaded from Inductor's graph cache
# (`benchmarks/compile_time.py`, SmolLM2's plain step, 2 Intel Xeon Skylake-SP cores: float32
# 131-133 s against 37-45 s, bf16 141 against 41 s).
COLD_OVER_CACHED_COMPILE = 3.0


def median_seconds(device: torch.device, call, repeats: int = REPEATS) -> float:
    """Median seconds of `call()` (after one untimed call)."""
    call()
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def cold_compile_seconds(functions: StepFunctions, name: tuple) -> float:
    """What compiling `name` took, or, where it was loaded from Inductor's graph cache, what
    lowering it anew would take: the estimate for variants this cache may not hold (a re-run that
    loaded its plain step in 40 s would otherwise expect a variant never compiled to take that
    long, not the 130 s it takes, and compile it for a job that cannot repay it); and at least the
    slowest lowering this process has seen (compile_clock.slowest_lowering: kernels built earlier for
    another runner make a plain step compile fast that its variants will not)."""
    seconds = functions.compile_seconds.get(name, 0.0)
    if name in functions.from_graph_cache:
        seconds *= COLD_OVER_CACHED_COMPILE
    return max(seconds, slowest_lowering()) if seconds else seconds


def eager_costs(functions: StepFunctions, kv_len: int, k_max: int) -> dict[int, float]:
    """Eager steps of k = 1 .. k_max drafts: k = 1 and k_max timed once each (nothing compiles: the
    plain step's untimed call has built every kernel they run), the k between them on the line
    through both (an eager step's time grows about linearly with its rows and draft passes: SmolLM2's
    EAGLE-3 at 16 slots, bf16, 2 AMD EPYC Zen 4 cores: 282 / 372 / 445 / 565 ms for k = 1..4, where
    the line gives 376 and 471). Every k timed four times had taken 5.1 s of a 170 s job's warm-up
    there; the policy refines each cost from the job's own steps."""
    def once(k: int) -> float:
        start = time.perf_counter()
        functions.step(kv_len, k + 1, k)
        return time.perf_counter() - start

    first = once(1)
    last = once(k_max) if k_max > 1 else first
    return {k: first + (last - first) * (k - 1) / max(1, k_max - 1) for k in range(1, k_max + 1)}


@torch.inference_mode()
def calibrate(policy: AdaptivePolicy, functions: StepFunctions, kv_len: int, slots: int) -> float:
    start = time.perf_counter()
    unified, device = functions.unified, functions.device
    state, caches, sampling = functions.state, functions.caches, functions.sampling
    state.active.zero_()
    k_max = unified.k
    key_index = functions.key_index(kv_len)
    plain = median_seconds(device, lambda: functions.verify(kv_len, 1))
    if functions.compiled:
        cost = {0: plain} | {k: median_seconds(device, lambda k=k: functions.step(kv_len, k + 1, k))
                             for k in sorted(functions.compiled_ks)}
    else:
        cost = {0: plain} | eager_costs(functions, kv_len, k_max)
    missing = [k for k in range(1, k_max + 1) if k not in cost]
    floor: dict[int, float] = {}
    # compile time estimates: a variant's verify costs what the plain step's did, its draft that
    # scaled by how much smaller the draft's work is
    verify_compile = max(cold_compile_seconds(functions, ("verify", 1)), MIN_COMPILE_SECONDS)
    step_compile: dict[int, float] = {}
    if missing:
        # Not compiled yet: eager times, scaled as the plain step scales from eager to compiled.
        def eager(call) -> float:
            return median_seconds(device, call, 1)

        plain_eager = eager(lambda: unified.verify_block(state, caches, sampling, key_index,
                                                         torch.arange(1, device=device)))
        ratio = min(1.0, plain / plain_eager)
        for k in missing:
            rows = torch.arange(k + 1, device=device)          # the draft's window and the verify's rows
            draft = eager(lambda k=k, r=rows: unified.draft_block(state, caches, sampling, key_index, r, k))
            verify = eager(lambda r=rows: unified.verify_block(state, caches, sampling, key_index, r))
            cost[k] = (verify + draft) * ratio
            # verifying k + 1 rows a slot costs at least what one row does (compiled, on a CPU, about
            # as much at one slot): the floor of a variant whose verify is only estimated
            floor[k] = plain + draft * ratio
            step_compile[k] = verify_compile * (1 + min(1.0, draft / plain_eager))

    def estimate_compiles() -> None:
        for k in range(1, k_max + 1):
            if k not in functions.compiled_ks:
                policy.compile_estimate[k] = max(MIN_COMPILE_SECONDS, step_compile.get(k, 0.0))

    estimate_compiles()
    for k in range(k_max + 1):
        policy.set_cost(k, slots, cost[k], estimated=k in missing, floor=floor.get(k))
    # The card's acceptance on a full batch of long requests: the variant the first steps will use,
    # compiled now where the job repays it.
    views = [SlotView(b, 1 << 30) for b in range(slots)]
    rates = policy.rates(views, slots)
    ready = {k: r for k, r in rates.items() if k == 0 or k in functions.compiled_ks}
    best = policy.worth_compiling(rates, ready, policy.rates(views, slots, floors=True))
    if best is not None:
        before = functions.compiled_seconds()
        functions.step(kv_len, best + 1, best)              # compiles it
        spent = functions.compiled_seconds() - before
        policy.set_cost(best, slots, median_seconds(device, lambda: functions.step(kv_len, best + 1, best)))
        # the others from what compiling this variant really took: its verify as the plain step's,
        # its draft in proportion to k
        measured = cold_compile_seconds(functions, ("step", best)) or spent
        draft_part = max(0.0, measured - verify_compile)
        step_compile = {k: verify_compile + draft_part * k / best for k in range(1, k_max + 1)}
        estimate_compiles()
    state.active.zero_()
    return time.perf_counter() - start
