"""What a run compiles and profiles before its first request, for each policy it runs with.

Contract: `WarmUp()` is a runner's; `warm_up(runner)` compiles (and on CUDA captures) what the run
needs up front and returns the seconds spent. Idempotent. A fixed k gets its variant compiled (its
draft and the verify of k + 1 rows); an adaptive policy gets the plain step, every variant's step
time (measured or estimated, pipelines/profile.py) and the variant it expects to use where the job
repays compiling it; host proposals' `auto` gets the plain step and K's estimated cost
(pipelines/host_policy.py). A hybrid's parts are prepared each as alone. A policy swapped in later
(`Runner.use_policy`) is prepared the same way at the next run. Its state: whether the run-wide
compile is `done`, and the policies `prepared`.
"""

from __future__ import annotations

import torch

from specgen.pipelines.host_policy import HostDraftPolicy
from specgen.pipelines.host_policy import profile as profile_host
from specgen.pipelines.host_policy import refresh as refresh_host
from specgen.pipelines.hybrid_policy import HybridPolicy
from specgen.pipelines.policy import AdaptivePolicy, FixedPolicy
from specgen.pipelines.prefill import PrefillItem, pack, plan_prefill


class WarmUp:
    def __init__(self) -> None:
        self.done = False
        self.prepared: list = []             # the policies prepared so far

    @torch.inference_mode()
    def __call__(self, runner) -> float:
        """The runner's warm-up (module docstring); seconds spent."""
        seconds = 0.0
        # a policy may stand behind a wrapper that shares its decisions (parallel/decisions.py:
        # `inner`); the wrapper is what is called, the policy inside is what it is
        kind = lambda p: getattr(p, "inner", p)  # noqa: E731
        hybrid = kind(runner.policy) if isinstance(kind(runner.policy), HybridPolicy) else None
        policy = hybrid.model if hybrid is not None else runner.policy
        if not self.done:
            self.done = True
            batches = []
            if runner.compiled and runner.functions.prefill_compiled:
                # The variants a run meets: one row and several rows (dynamic shapes specialise on 1).
                # Their limit 0 leaves the slots inactive.
                items = [PrefillItem(b, [0] * 3, 0, 0) for b in range(min(2, runner.batch_size))]
                for rows in sorted({1, len(items)}):
                    call = plan_prefill(items[:rows], chunk=runner.prefill.chunk, budget=runner.prefill.budget)[0]
                    key_index = runner.functions.key_index(runner.kv_bucket(call.width))
                    batches.append(pack(call, runner.alloc_len, key_index, runner.device))
            # a fixed k > 0 never runs the plain step; an adaptive policy starts from it (profile.py)
            seconds += self.compile_variant(runner, policy.k if isinstance(kind(policy), FixedPolicy) else 0, batches)
        if any(p is runner.policy for p in self.prepared):
            host = hybrid.host if hybrid is not None and hybrid.adaptive else policy
            if isinstance(kind(host), HostDraftPolicy) and host.estimated:
                seconds += refresh_host(host, runner.functions, runner.kv_bucket(0), runner.batch_size)
            return seconds
        self.prepared.append(runner.policy)
        if isinstance(kind(policy), AdaptivePolicy):
            from specgen.pipelines.profile import calibrate

            spent = calibrate(policy, runner.functions, runner.kv_bucket(0), runner.batch_size)
            seconds += spent if runner.compiled else 0.0     # eager: profiling is part of the run
        if isinstance(kind(policy), HostDraftPolicy) or (hybrid is not None and hybrid.adaptive):
            from specgen.pipelines.profile import MIN_COMPILE_SECONDS, cold_compile_seconds

            cold = max(cold_compile_seconds(runner.functions, ("verify", 1)), MIN_COMPILE_SECONDS)
            host = hybrid.host if hybrid is not None else policy
            spent = profile_host(host, runner.functions, runner.kv_bucket(0), runner.batch_size, cold)
            seconds += spent if runner.compiled else 0.0
        if isinstance(kind(policy), FixedPolicy):
            k = policy.k
            if not (runner.functions.verify_ready(1) if k == 0 else k in runner.functions.compiled_ks):
                seconds += self.compile_variant(runner, k, [])
        return seconds

    def compile_variant(self, runner, k: int, prefill_batches: list) -> float:
        """Compile variant k before the run (k = 0: the plain step; with host drafts alone a fixed k
        runs plain steps too, wherever no slot has a proposal; a hybrid's fixed k runs the verify of
        its host drafts alone too, wherever every slot takes them); seconds spent."""
        return runner.functions.warm_up(runner.kv_bucket(0), prefill_batches, (k,) if k else (),
                                      plain=not k or (runner.proposer is not None and not runner.hybrid),
                                      verifies=(k + 1,) if k and runner.hybrid else ())

