"""The batch loop: continuous batching around the unified step, with a host that never stalls the device.

Contract: `Runner.run(requests, on_finish, on_progress)` pushes every request through the step and
calls `on_finish(Completion)` exactly once per request, in finishing order, errors included (a request
that fails never stops the others). The loop admits requests into free slots, chooses k for each step
(a `policy`, pipelines/policy.py: fixed, or adaptive), issues the draft of k tokens (none for k = 0)
and the verify of k + 1 rows per slot (pipelines/unified.py), tells the policy what each step
accepted and how long it took, and hands each request its committed tokens until a stop, EOS or
max_tokens ends it. The host side of each step is ONE device->host read of a `[B, k+4]` tensor
(accepted, accepted only by relaxed acceptance, the last committed token, emitted; with logprobs,
each token's packed logprobs after them). On CUDA the loop issues step n+1 BEFORE it reads step n
(pipelines/host_reader.py), so the host's Python work overlaps the device; a slot that finished at
step n therefore runs once more, harmlessly (its results are ignored, and the device stops a slot at
its length limit by itself). On CPU nothing runs asynchronously, so there is no lag.
The loop's helpers each keep their own state, in modules of their own:
- pipelines/admission.py: the prompt checks and the batched prefill of the admitted requests;
- pipelines/slot_grammars.py: structured output's per-slot grammar states and row masks;
- pipelines/host_drafts.py: drafts made on the host (suffix, forced tokens) placed into the step;
- pipelines/narrowing.py: a run's tail stepped over the live slots only;
- pipelines/warm_up.py: what a run compiles and profiles before its first request, per policy;
- pipelines/requests.py: what goes in and comes out (requests, completions, totals).
It knows nothing of files, recipes or terminals: progress goes to a callback.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import torch

from specgen.drafts.forced import ForcedProposer
from specgen.kernels.keyed_noise import noise_key_for
from specgen.pipelines.admission import CPU_KV_GRANULE, Prefill, admit
from specgen.pipelines.compiled import StepFunctions
from specgen.pipelines.host_drafts import HostDrafts
from specgen.pipelines.host_policy import HostDraftPolicy
from specgen.pipelines.host_reader import HostReader
from specgen.pipelines.hybrid_policy import HybridPolicy
from specgen.pipelines.logprobs import unpack
from specgen.pipelines.narrowing import move_rows, plan_narrowing
from specgen.pipelines.policy import AdaptivePolicy, FixedPolicy, SlotView
from specgen.pipelines.reasoning import ReasoningMarkers
from specgen.pipelines.requests import Completion, Progress, Request, RunTotals, Slot, completion_of
from specgen.pipelines.slot_grammars import SlotGrammars
from specgen.pipelines.stats import SpecCounters
from specgen.pipelines.stops import StopRules
from specgen.pipelines.unified import UnifiedStep
from specgen.pipelines.warm_up import WarmUp
from specgen.sampling import SamplingTensors
from specgen.structured.grammar import GrammarEngine

MIN_KV_BUCKET = 256


class Runner:
    def __init__(self, step: UnifiedStep, *, batch_size: int, max_seq_len: int, rules: StopRules,
                 sampling: SamplingTensors, seed: int, device: torch.device, dtype: torch.dtype,
                 compile: bool = False, overlap: bool | None = None, prefill_chunk: int | None = None,
                 prefill_budget: int | None = None, reasoning: ReasoningMarkers | None = None,
                 policy: AdaptivePolicy | FixedPolicy | HostDraftPolicy | HybridPolicy | None = None,
                 proposer=None, grammar: GrammarEngine | None = None, jump_forward: bool = True) -> None:
        self.unified = step
        # structured output: requests with a response_format get a grammar state each, and the
        # step's rows their token masks (`_write_masks`); needs a step built with structured=True
        assert grammar is None or step.structured, "a grammar engine needs a structured step"
        self.grammar = grammar
        self.state = step.new_state(batch_size, device, dtype)
        # the structured slots' states and their rows' token masks (pipelines/slot_grammars.py); a
        # draft the grammar refuses gives way to the tokens the grammar forces (`jump_forward`)
        self.grammars = (SlotGrammars(grammar, self.state, jump_forward)
                         if self.state.token_masks is not None else None)
        if grammar is not None and jump_forward and (step.host_drafts or (step.draft is None and step.k > 0)):
            # where the host drafts (no draft model, suffix drafting, a hybrid), the grammar's forced
            # tokens are proposals too (drafts/forced.py)
            proposer = ForcedProposer(self.grammars.states, proposer)
        # the step's relaxed acceptance and the slots' start states must read the same markers
        relaxed = step.relaxed.markers if step.relaxed is not None else None
        assert reasoning is None or relaxed is None or reasoning == relaxed, "two sets of reasoning markers"
        self.reasoning = reasoning if reasoning is not None else relaxed
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.rules = rules
        self.sampling = sampling
        self.seed = seed
        self.device = device
        # Drafts made on the host (a `drafts.suffix.SuffixProposer`, with a step built with host_k, or
        # beside a draft model with host_drafts: a hybrid) continue the tokens committed so far.
        self.proposer = proposer
        self.hybrid = proposer is not None and step.draft is not None
        assert not self.hybrid or step.host_drafts, "a hybrid's step takes host drafts (host_drafts=True)"
        self._hybrids: dict[int, HybridPolicy] = {}     # a model policy's hybrid (see _bound)
        self.policy = self._bound(policy if policy is not None else FixedPolicy(step.k))
        self.alloc_len = max_seq_len + step.scratch_len()
        self.caches = step.new_caches(batch_size, self.alloc_len, dtype, device)
        self.lag = int(device.type == "cuda" if overlap is None else overlap)
        if proposer is not None or grammar is not None:
            # a step's host drafts, and its rows' token masks, need the previous step's tokens:
            # issued once it is read
            self.lag = 0
        self.functions = StepFunctions(step, self.state, self.caches, sampling, device=device,
                                       compile=compile)
        self._compiled = self.functions.compiled
        # admission's checks and the prefill (pipelines/admission.py); on CPU each prompt alone
        self.prefill = Prefill(step, self.functions, self.state, device=device, alloc_len=self.alloc_len,
                               max_seq_len=max_seq_len, kv_bucket=self.kv_bucket, noise_key=self.noise_key,
                               on_call=self._count_prefill_call, chunk=prefill_chunk, budget=prefill_budget)
        self.host = HostDrafts(proposer, self.state, batch_size, step.k, self.hybrid) if proposer is not None else None
        # per token of a step's output: 1 column, and the packed logprobs when asked for
        self.lp_width = step.logprobs.width if step.logprobs is not None else 0
        self.reader = HostReader(device, (batch_size, step.k + 4 + (step.k + 2) * self.lp_width), self.lag + 1)
        self._warm_up = WarmUp()
        self.step_no = 0
        self.width = batch_size       # slots the step runs over (fewer in a run's tail, see _narrow)
        # positions each slot's draft has not absorbed yet (a bound: the draft's catch-up window)
        self.gaps = [0] * batch_size
        # slots whose draft did not read their prompt (the policy had ruled drafting out: see
        # `keeps_draft_state`): their drafts are worth nothing, their gaps are not kept
        self.cold: set[int] = set()
        self.last_k = 0               # k of the last step issued
        self.totals = RunTotals(spec=SpecCounters(step.k))  # live: readable after an interrupt

    @property
    def compiled(self) -> bool:
        return self._compiled

    def kv_bucket(self, longest: int, k: int | None = None) -> int:
        """Keys the reference attention reads in a step of k drafts (default the step's K): enough for
        every slot (a multiple of 64 on CPU, a power of two on CUDA), at most the allocation less one
        (no query that matters sits at the last scratch entry, and a bound below the cache length
        keeps the compiled step's bound dynamic). The kernel path reads per-row lengths and takes the
        whole allocation."""
        if self.unified.use_kernel:
            return self.alloc_len
        # Steps still in flight may each have committed up to K + 1 tokens the host has not seen. A
        # step's own rows and scratch follow its k, not K: bounded by K, auto's plain steps read 3K
        # keys per row more than a plain job's (21 for DFlash's K = 7: a third of a granule).
        k = self.unified.k if k is None else k
        need = longest + self.lag * (self.unified.k + 1) + (k + 1) + self.unified.scratch_len(k)
        if self.device.type == "cpu":
            # every key read costs on CPU, and the compiled step takes the bound as a dynamic size
            bucket = -(-need // CPU_KV_GRANULE) * CPU_KV_GRANULE
        else:
            bucket = MIN_KV_BUCKET          # few sizes: each is a CUDA graph of its own
            while bucket < need:
                bucket *= 2
        return min(bucket, self.alloc_len - 1)

    def warm_up(self) -> float:
        """Compile (and capture) what the run needs up front; seconds spent (pipelines/warm_up.py)."""
        return self._warm_up(self)

    @property
    def warmed(self) -> bool:
        return self._warm_up.done

    def use_policy(self, policy: AdaptivePolicy | FixedPolicy | HostDraftPolicy | HybridPolicy) -> None:
        """Choose k with `policy` from the next run on (bench: fixed K and auto over one compiled
        step). Its k never exceeds the step's K."""
        assert (policy.k if isinstance(policy, FixedPolicy) else policy.k_max) <= self.unified.k
        assert self.proposer is None or self.hybrid or not isinstance(policy, AdaptivePolicy), \
            "host drafts alone: HostDraftPolicy"
        self.policy = self._bound(policy)

    def _bound(self, policy):
        """A hybrid runner's policy is a HybridPolicy: a model policy given alone (bench's pinned K on
        a shared runner, tests) gets the host part beside it, once per policy. A pinned K's acceptance
        estimate starts from the prior of the runner's first hybrid (the job's card), else a neutral one."""
        if not self.hybrid or isinstance(policy, HybridPolicy):
            if isinstance(policy, HybridPolicy):
                self._hybrids.setdefault(id(policy.model), policy)
            return policy
        bound = self._hybrids.get(id(policy))
        if bound is None:
            k_max = self.unified.k
            first = next(iter(self._hybrids.values()), None)
            estimator = AdaptivePolicy(k_max, list(first.estimator.prior) if first is not None else [0.5] * k_max)
            bound = self._hybrids[id(policy)] = HybridPolicy(policy, HostDraftPolicy(k_max), estimator)
        return bound

    def close(self) -> None:
        """Release compiled code and CUDA-graph memory (several runners in one process)."""
        if self._compiled and self.functions is not None:
            torch._dynamo.reset()
        self.functions = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- the loop -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, requests: Iterable[Request], on_finish: Callable[[Completion], None],
            on_progress: Callable[[Progress], None] | None = None,
            on_status: Callable[[str], None] | None = None, suffix_job=None) -> RunTotals:
        """`on_status(line)` hears about the one-time warm-up (compilation) before any request.
        `suffix_job`: with host proposals, the job-wide index to carry on (drafts.suffix.SuffixProposer.
        new_job; bench's legs of one round), else a new one."""
        totals = self.totals = RunTotals(spec=SpecCounters(self.unified.k))
        start = time.perf_counter()
        if self.proposer is not None:
            self.proposer.reset(suffix_job)   # what a run learns from its outputs stays in that run

        def finish(completion: Completion) -> None:
            totals.requests += 1
            totals.errors += completion.finish_reason == "error"
            totals.output_tokens += len(completion.token_ids)
            if completion.spec is not None:
                totals.spec.merge(completion.spec)
            on_finish(completion)
            if on_progress is not None:
                on_progress(Progress(totals.requests, totals.output_tokens,
                                     time.perf_counter() - start, totals.spec))

        try:
            if on_status is not None and self.compiled and not self.warmed:
                what = "the step and the prefill" if self.functions.prefill_compiled else "the step"
                on_status(f"compiling {what} (once; Inductor's disk cache speeds up later runs)")
            totals.compile_seconds = self.warm_up()
            if on_status is not None and totals.compile_seconds:
                on_status(f"compiled in {totals.compile_seconds:.1f} s")
            self._loop(iter(requests), finish, totals)
        finally:
            totals.wall_seconds = time.perf_counter() - start
        return totals

    def _loop(self, pending: Iterator[Request], finish, totals: RunTotals) -> None:
        self.state.active.zero_()                       # an interrupted run may have left slots live
        self.cold.clear()
        if self.grammars is not None:                   # ... and structured slots' mask rows
            self.grammars.reset()
        if self.width != self.batch_size:               # a previous run ended narrowed
            self.width = self.batch_size
            self.functions.use_slots(self.batch_size)
        totals.k_steps = [0] * (self.unified.k + 1)
        slots: list[Slot | None] = [None] * self.batch_size
        lengths = [0] * self.batch_size          # host mirror of cache_lens, for the kv bucket
        # (step number, k, each slot's host drafts or None, the read of its output)
        inflight: deque[tuple[int, int, dict | None, Callable[[], list[list[int]]]]] = deque()
        more = True
        while True:
            free = [b for b in range(self.batch_size) if slots[b] is None]
            if free and more:
                more = admit(self, free, pending, slots, lengths, finish, totals)
            after_admission = time.perf_counter()
            live = [b for b in range(self.batch_size) if slots[b] is not None]
            timed = None
            if live:
                k, timed = self._issue(live, slots, lengths, inflight, totals)
            if not inflight:
                if more:
                    continue              # every admitted request failed: admit the next ones
                break
            if len(inflight) > self.lag or not live:
                number, k_read, drafted, read = inflight.popleft()
                self._absorb(number, k_read, drafted, read(), slots, lengths, finish)
            stepped = time.perf_counter() - after_admission     # the iteration, admission left out
            totals.step_seconds += stepped
            if timed is not None:         # the step's cost
                self.policy.observe_step(timed, self.width, stepped)
            if not more and not inflight:
                self._narrow(slots, lengths)

    def _issue(self, live: list[int], slots: list[Slot | None], lengths: list[int], inflight,
               totals: RunTotals) -> tuple[int, int | None]:
        """Choose k, draft k tokens (none for k = 0), verify k + 1 rows per slot. Returns k and, when
        this step's time is its variant's steady cost, k again (None after a compile or a catch-up)."""
        functions = self.functions
        views = [SlotView(b, slots[b].tracker.max_tokens - len(slots[b].tracker.token_ids), self.gaps[b],
                          drafts=b not in self.cold) for b in live]
        # the policy runs a variant that is not compiled only where it decided compiling it pays
        # (pipelines/policy.py): the verify decides the tokens, and only the compiled graph computes
        # them exactly as the plain step does
        k = self.policy.choose(views, functions.compiled_ks, self.width)
        drafted, host_only = None, False
        if self.host is not None:
            k, drafted, host_only = self.host.plan(live, k, self.policy, functions, self.width, self.compiled)
        kv_len = self.kv_bucket(max(lengths[b] for b in live), k)
        steady = True
        compiled_before = functions.compiled_seconds()
        if self.unified.draft is not None and (host_only or k == 0) \
                and max(self.gaps[b] for b in live) + k + 1 > self.unified.max_window:
            # A step the draft does not run in (plain, or the host's drafts alone) that would leave a
            # slot further behind than a catch-up reads back from the ring (max_window; host-only steps
            # move K + 1 positions each, and a policy that runs plain throughout never probes): the
            # draft absorbs now what it has not read, a pass that proposes nothing, so its state stays
            # what it would have been (DESIGN.md section 7). Once per max_window - K - 1 positions at
            # most; a one-off, not this step's cost.
            functions.catch_up(kv_len, max(self.gaps[b] for b in live))
            for b in range(self.batch_size):
                self.gaps[b] = 0
            steady = False
            totals.catch_ups += 1
        if host_only:
            # the host's drafts are in `pending`: the verify of k + 1 rows (a draft model, if any, does
            # not run: it absorbs these positions at its next step, from the ring the verify writes)
            self._write_masks(k)
            out = functions.verify(kv_len, k + 1)
        elif k > 0:
            window = max(self.gaps[b] for b in live)
            out = functions.step(kv_len, window, k, between=self._write_masks if self._structured_slots() else None)
            # a draft catching up on plain steps' positions (after a run of k = 0) costs more than
            # drafting does in a run of k (measured: 10.5 ms for 53 positions against 1.9 for 2, EAGLE-3
            # on SmolLM2, fp32): a one-off, not the variant's cost, however short the run (the policy
            # samples a variant's cost where its step follows another's: those were catch-ups).
            steady = window <= self.last_k + 1
            for b in range(self.batch_size):
                self.gaps[b] = 0
        else:
            self._write_masks(0)
            out = functions.verify(kv_len, 1)
        compiled = functions.compiled_seconds() - compiled_before     # a variant built at first use
        totals.compile_seconds += compiled
        steady = steady and compiled == 0
        for b in live:
            if b not in self.cold:
                self.gaps[b] += k + 1
        self.last_k = k
        inflight.append((self.step_no, k, drafted, self.reader.start(out)))
        self.step_no += 1
        totals.steps += 1
        totals.k_steps[k] += 1
        return k, (k if steady else None)

    def _write_masks(self, k: int) -> None:
        """The token masks of the k + 1 rows each structured slot verifies (pipelines/slot_grammars.py)."""
        if self.grammars is not None:
            self.grammars.write(k, self.totals)

    def _structured_slots(self) -> bool:
        return self.grammars is not None and bool(self.grammars.states)

    def _narrow(self, slots: list[Slot | None], lengths: list[int]) -> None:
        """In the tail of a run, step over the live slots only (pipelines/narrowing.py): eager steps
        without a step in flight."""
        if self.compiled or self.lag:
            return
        plan = plan_narrowing([b for b in range(self.width) if slots[b] is not None], self.width)
        if plan is None:
            return
        width, moves = plan
        tensors = (*self.state.tensors(), *self.caches.tensors(), *self.sampling.tensors())
        for src, dst in moves:
            move_rows(tensors, src, dst)
            self.state.active[src] = False
            slots[dst], slots[src] = slots[src], None
            lengths[dst] = lengths[src]
            self.gaps[dst] = self.gaps[src]
            if src in self.cold:
                self.cold.discard(src)
                self.cold.add(dst)
            if self.grammars is not None:
                self.grammars.move(src, dst)
            self.policy.move(src, dst)
            if self.proposer is not None:
                self.proposer.move(src, dst)
        self.width = width
        self.functions.use_slots(width)

    def _absorb(self, number: int, k: int, drafted: dict[int, int] | None, rows: list[list[int]],
                slots: list[Slot | None], lengths: list[int], finish) -> None:
        """Feed the results of step `number` (which drafted k; `drafted`: each slot's own count,
        host drafts only) to the requests they belong to."""
        proposer = self.proposer
        for b, slot in enumerate(slots):
            if slot is None or slot.first_step > number:
                continue                  # a free slot, or one refilled after this step was issued
            accepted, relaxed, last, emitted = rows[b][0], rows[b][1], rows[b][2], rows[b][3:]
            # a request's first step also brings its first token, sampled by the prefill
            if number == slot.first_step:
                if proposer is not None:
                    proposer.extend(b, (last,))
                if slot.logprobs is not None:
                    slot.logprobs.append(self._logprobs(rows[b], k, -1, last))
                # (its grammar took it at admission: the step's masks needed it)
                if slot.take(last, in_grammar=True):
                    self._release(b, slots, finish)
                    continue
            if drafted is None:
                slot.counters.record(accepted, relaxed, k)
            else:
                # a slot counts its own proposal (vLLM's definitions); a pad that was kept is output,
                # not an accepted draft
                own = drafted.get(b, 0)
                slot.counters.record(min(accepted, own), min(relaxed, own), own)
            # a cold slot's drafts say nothing of the draft's acceptance: reported as a plain step's
            self.policy.observe_block(b, 0 if b in self.cold else k, accepted)
            lengths[b] += accepted + 1
            committed = emitted[: accepted + 1]
            if proposer is not None:
                self.policy.observe_tokens(b, committed)
            for i, token in enumerate(committed):
                if proposer is not None:
                    proposer.extend(b, (token,))     # up to the last token the output keeps
                if slot.logprobs is not None:
                    slot.logprobs.append(self._logprobs(rows[b], k, i, token))
                if slot.take(token):
                    self._release(b, slots, finish)
                    break

    def _logprobs(self, row: list[int], k: int, i: int, token: int) -> dict:
        """The record entry of emitted token i (-1: the first token, sampled by the prefill) of a slot's
        output row from a step of k drafts (layout: pipelines/unified.py)."""
        start = 3 + (k + 1) + (i + 1) * self.lp_width
        return unpack(row[start:start + self.lp_width], token, self.unified.logprobs.top)

    def _release(self, b: int, slots: list[Slot | None], finish) -> None:
        finish(completion_of(slots[b], self.reasoning, self.rules))
        slots[b] = None
        self.cold.discard(b)
        if self.grammars is not None:
            self.grammars.free(b)
        if self.proposer is not None:
            self.proposer.finish(b)
        # The device would stop the slot only at its length limit; a stop string or EOS ends it here
        # (queued behind any step already in flight, which then runs it once more, harmlessly).
        self.state.active[b] = False

    def _count_prefill_call(self) -> None:
        self.totals.prefill_calls += 1      # the run's totals at the time (live after an interrupt)

    def noise_key(self, request: Request) -> int:
        return noise_key_for(self.seed, request.request_key)
