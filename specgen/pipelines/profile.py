"""Warm-up profiling for the adaptive policy: what every variant of the step costs, before any request.

Contract: `calibrate(policy, functions, kv_len, slots)` runs with every slot inactive (nothing
advances; every write lands in scratch entries) and:
- times verify at every T = 1..K_max + 1 (two compiled graphs serve them all, so this compiles
  nothing) and the draft of every k that runs without compiling (every k when steps run eagerly);
- for draft variants that would need compiling, estimates their compiled time (their eager time
  scaled by verify's compiled/eager ratio) and their compile time (verify's, scaled by how much
  smaller the draft's work is, until a draft variant has been compiled and timed);
- gives the policy `cost(k) = verify(k + 1) + draft(k)` for every k, and, when the card's acceptance
  says some k > 0 beats plain decoding on a full batch, compiles that draft now (the first steps
  need it) and times it.
Returns the seconds spent. Step times keep being refined by the policy during the run.
"""

from __future__ import annotations

import statistics
import time

import torch

from specgen.pipelines.compiled import StepFunctions
from specgen.pipelines.policy import MIN_GAIN, AdaptivePolicy, SlotView

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
    verify = {t: _time(device, lambda t=t: functions.verify(kv_len, t)) for t in range(1, k_max + 2)}
    draft: dict[int, float] = {}
    for k in functions.compiled_ks:
        draft[k] = _time(device, lambda k=k: functions.draft(kv_len, k + 1, k))
    missing = [k for k in range(1, k_max + 1) if k not in draft]
    if missing:
        # Not compiled yet: eager times, scaled as verify scales from eager to compiled.
        key_index = functions.key_index(kv_len)
        rows = torch.arange(1, device=device)
        eager_verify = _time(device, lambda: unified.verify_block(state, caches, sampling, key_index, rows), 1)
        ratio = min(1.0, verify[1] / eager_verify)
        verify_compile = functions.compile_seconds.get("verify", 0.0)
        for k in missing:
            window = torch.arange(k + 1, device=device)
            eager = _time(device, lambda k=k, w=window: unified.draft_block(state, caches, sampling, key_index,
                                                                            w, k), 1)
            draft[k] = eager * ratio
            share = min(1.0, eager / eager_verify)
            policy.compile_estimate[k] = max(MIN_COMPILE_SECONDS, verify_compile * share)
    for k in range(k_max + 1):
        policy.set_cost(k, slots, verify[k + 1] + draft.get(k, 0.0))
    # The card's acceptance on a full batch of long requests: the draft the first steps will use.
    rates = policy.rates([SlotView(b, 1 << 30) for b in range(slots)], slots)
    best = max(rates, key=rates.get)
    if best > 0 and best in missing and rates[best] >= rates[0] * (1 + MIN_GAIN):
        functions.draft(kv_len, best + 1, best)              # compiles it
        policy.set_cost(best, slots, verify[best + 1] + _time(device, lambda: functions.draft(kv_len, best + 1, best)))
        compiled = functions.compile_seconds.get(best)
        if compiled:
            for k in missing:
                if k != best:
                    policy.compile_estimate[k] = max(MIN_COMPILE_SECONDS, compiled * k / best)
    state.active.zero_()
    return time.perf_counter() - start
