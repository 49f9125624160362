"""Warm-up profiling for the adaptive policy: what every variant of the step costs, before any request.

Contract: `calibrate(policy, functions, kv_len, slots)` runs with every slot inactive (nothing
advances; every write lands in scratch entries) and:
- times the plain step (the verify of one row per slot, compiled first if it is not yet) and every
  variant k that runs without compiling (its draft and the verify of k + 1 rows; every k when steps
  run eagerly);
- for the parts that would need compiling, estimates their compiled time (their eager time scaled by
  the plain step's compiled/eager ratio) and their compile time (a verify graph: what the plain
  step's took; a draft: that, scaled by how much smaller the draft's work is);
- gives the policy `cost(k) = verify(k + 1) + draft(k)` for every k (and, where verify(k + 1) is
  only estimated, its floor `verify(1) + draft(k)`), and compiles now the variant
  that the card's acceptance says the job repays (`AdaptivePolicy.worth_compiling`: the time it is
  expected to save over the job's tokens at least twice its compile time, or, as a trial, four
  times at its floor), then times it (its profiled time replaces the estimate).
Returns the seconds spent. Step times keep being refined by the policy during the run.
"""

from __future__ import annotations

import statistics
import time

import torch

from specgen.pipelines.compiled import StepFunctions
from specgen.pipelines.policy import AdaptivePolicy, SlotView

REPEATS = 3
MIN_COMPILE_SECONDS = 5.0


def _time(device: torch.device, call, repeats: int = REPEATS) -> float:
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


@torch.inference_mode()
def calibrate(policy: AdaptivePolicy, functions: StepFunctions, kv_len: int, slots: int) -> float:
    start = time.perf_counter()
    unified, device = functions.unified, functions.device
    state, caches, sampling = functions.state, functions.caches, functions.sampling
    state.active.zero_()
    k_max = unified.k
    key_index = functions.key_index(kv_len)
    verify = {t: _time(device, lambda t=t: functions.verify(kv_len, t))
              for t in range(1, k_max + 2) if t == 1 or functions.verify_ready(t)}
    draft = {k: _time(device, lambda k=k: functions.draft(kv_len, k + 1, k))
             for k in range(1, k_max + 1) if functions.draft_ready(k)}

    def eager_verify(t: int) -> float:
        rows = torch.arange(t, device=device)
        return _time(device, lambda: unified.verify_block(state, caches, sampling, key_index, rows), 1)

    missing_verify = [t for t in range(2, k_max + 2) if t not in verify]
    missing_draft = [k for k in range(1, k_max + 1) if k not in draft]
    # compile time estimates: a verify graph costs what the plain step's did, a draft its share of it
    verify_compile = max(functions.compile_seconds.get(("verify", 1), 0.0), MIN_COMPILE_SECONDS)
    draft_compile: dict[int, float] = {}
    if missing_verify or missing_draft:
        # Not compiled yet: eager times, scaled as the plain step scales from eager to compiled.
        plain_eager = eager_verify(1)
        ratio = min(1.0, verify[1] / plain_eager)
        for t in missing_verify:
            verify[t] = eager_verify(t) * ratio
        for k in missing_draft:
            window = torch.arange(k + 1, device=device)
            eager = _time(device, lambda k=k, w=window: unified.draft_block(state, caches, sampling, key_index,
                                                                            w, k), 1)
            draft[k] = eager * ratio
            draft_compile[k] = verify_compile * min(1.0, eager / plain_eager)

    def estimate_compiles() -> None:
        for k in range(1, k_max + 1):
            if k not in functions.compiled_ks:
                seconds = ((0.0 if functions.verify_ready(k + 1) else verify_compile)
                           + (0.0 if functions.draft_ready(k) else draft_compile.get(k, 0.0)))
                policy.compile_estimate[k] = max(MIN_COMPILE_SECONDS, seconds)

    estimate_compiles()
    for k in range(k_max + 1):
        estimated = k + 1 in missing_verify or k in missing_draft
        # verifying k + 1 rows a slot costs at least what one row does (compiled, on a CPU, about as
        # much at one slot): the floor of a variant whose verify is only estimated
        floor = verify[1] + draft.get(k, 0.0) if k + 1 in missing_verify else None
        policy.set_cost(k, slots, verify[k + 1] + draft.get(k, 0.0), estimated=estimated, floor=floor)
    # The card's acceptance on a full batch of long requests: the variant the first steps will use,
    # compiled now where the job repays it.
    views = [SlotView(b, 1 << 30) for b in range(slots)]
    rates = policy.rates(views, slots)
    ready = {k: r for k, r in rates.items() if k == 0 or k in functions.compiled_ks}
    best = policy.worth_compiling(rates, ready, policy.rates(views, slots, floors=True))
    if best is not None:
        before = functions.compiled_seconds()
        functions.draft(kv_len, best + 1, best)              # compiles them
        functions.verify(kv_len, best + 1)
        spent = functions.compiled_seconds() - before
        policy.set_cost(best, slots, _time(device, lambda: functions.verify(kv_len, best + 1))
                        + _time(device, lambda: functions.draft(kv_len, best + 1, best)))
        # the others from what compiling this variant really took
        verify_compile = functions.compile_seconds.get(("verify", best + 1)) or spent
        measured_draft = functions.compile_seconds.get(best)
        if measured_draft:
            draft_compile = {k: measured_draft * k / best for k in range(1, k_max + 1)}
        estimate_compiles()
    state.active.zero_()
    return time.perf_counter() - start
