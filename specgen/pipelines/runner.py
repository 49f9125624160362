"""The batch loop: continuous batching around the unified step, with a host that never stalls the device.

Contract: `Runner.run(requests, on_finish, on_progress)` pushes every request through the step and
calls `on_finish(Completion)` exactly once per request, in finishing order, errors included (a request
that fails never stops the others). It owns:
- admission: free slots are refilled together, in one batched prefill (pipelines/prefill.py);
- choosing k for each step (a `policy`, pipelines/policy.py: fixed, or adaptive), then issuing the
  draft of k tokens (none for k = 0) and the verify of k + 1 rows per slot (pipelines/unified.py),
  and telling the policy what each step accepted and how long it took;
- the host side of each step: ONE device->host read per step of a `[B, k+4]` tensor (accepted,
  accepted only by relaxed acceptance, the last committed token, emitted; with logprobs, each
  token's packed logprobs after them). On CUDA the loop issues
  step n+1 BEFORE it reads step n (through a pinned buffer and an event), so the host's Python work
  overlaps the device; a slot that finished at step n therefore runs once more, harmlessly (its
  results are ignored, and the device stops a slot at its length limit by itself). On CPU nothing
  runs asynchronously, so there is no lag;
- stop / EOS / max_tokens handling and per-request acceptance counters;
- reasoning (given `ReasoningMarkers`): each slot starts in the state its prompt leaves it in, and
  a completion's reasoning is split from its text (pipelines/reasoning.py).
It knows nothing of files, recipes or terminals: progress goes to a callback.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from specgen.drafts.forced import ForcedProposer
from specgen.kernels.keyed_noise import noise_key_for
from specgen.pipelines.compiled import StepFunctions
from specgen.pipelines.host_policy import HostDraftPolicy
from specgen.pipelines.host_policy import profile as profile_host
from specgen.pipelines.host_policy import refresh as refresh_host
from specgen.pipelines.hybrid_policy import HybridPolicy
from specgen.pipelines.policy import AdaptivePolicy, FixedPolicy, SlotView
from specgen.pipelines.logprobs import unpack
from specgen.pipelines.prefill import PrefillItem, pack, plan_prefill
from specgen.pipelines.reasoning import ReasoningMarkers, split, start_state
from specgen.pipelines.stats import SpecCounters
from specgen.pipelines.stops import OutputTracker, StopRules, cut_at_stop
from specgen.pipelines.unified import UnifiedStep
from specgen.sampling import SamplingTensors
from specgen.structured.formats import ResponseFormat
from specgen.structured.grammar import GrammarEngine, GrammarError, SlotGrammar

MIN_KV_BUCKET = 256
CPU_KV_GRANULE = 64
# Prefill: prompt tokens per chunk, and padded tokens per call (bounds activation memory).
PREFILL_CHUNK = {"cpu": 512, "cuda": 2048}
PREFILL_BUDGET = {"cpu": 4096, "cuda": 16384}


@dataclass(slots=True)
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    request_key: int                 # position-keyed noise depends on (seed, request_key, position)
    error: str | None = None         # a request that failed before generation (bad line, tokenizer)
    generation_start: int = 0        # where the chat template's generation prompt starts in prompt_ids
    response_format: ResponseFormat | None = None   # the output's constraint (specgen/structured)


@dataclass(slots=True)
class Completion:
    id: str
    token_ids: list[int]
    text: str
    finish_reason: str               # stop | length | error
    num_prompt_tokens: int
    spec: SpecCounters | None
    error: str | None = None
    reasoning_text: str | None = None    # the reasoning, split from `text` (None: there was none)
    num_reasoning_tokens: int = 0
    logprobs: list[dict] | None = None   # one entry per token of token_ids (pipelines/logprobs.py)
    prompt_logprobs: list[dict | None] | None = None   # one per prompt token (the first: None)


@dataclass(slots=True)
class Progress:
    finished: int
    output_tokens: int
    elapsed: float
    totals: SpecCounters

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.elapsed if self.elapsed > 0 else 0.0


@dataclass(slots=True)
class _Slot:
    request: Request
    tracker: OutputTracker
    counters: SpecCounters
    first_step: int                  # the first step whose results belong to this request
    reasoning_start: bool | None = None   # the state the prompt leaves the output in
    logprobs: list[dict] | None = None    # one entry per token added to the tracker (logprobs on)
    prompt_logprobs: list[dict | None] | None = None
    grammar: SlotGrammar | None = None    # the response format's state over the committed tokens
    error: str | None = None


@dataclass(slots=True)
class RunTotals:
    requests: int = 0
    errors: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    prefill_calls: int = 0
    wall_seconds: float = 0.0
    # compilation and CUDA-graph capture at warm-up, and mid-run: a variant's first use, a recompile,
    # a CUDA graph recorded for a new kv bucket or draft window (pipelines/compile_clock.py)
    compile_seconds: float = 0.0
    step_seconds: float = 0.0        # the steps' iterations, admission (prefill) left out (inside wall_seconds)
    mask_seconds: float = 0.0        # structured output: the host's token masks (inside step_seconds)
    grammar_drafts: int = 0          # structured output: drafts the grammar wrote (its forced tokens)
    refused_drafts: int = 0          # structured output: slot-steps stopped at a draft the grammar refuses
    catch_ups: int = 0               # draft passes run alone, to keep a draft within its window (_issue)
    unabsorbed_prompts: int = 0      # prompts the draft did not read: drafting was ruled out (_admit)
    spec: SpecCounters = field(default_factory=lambda: SpecCounters(0))
    k_steps: list[int] = field(default_factory=list)    # steps run with each k (0 = plain)

    @property
    def tokens_per_second(self) -> float | None:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else None

    @property
    def steady_tokens_per_second(self) -> float | None:
        """Throughput with the warm-up left out (what a longer job tends to)."""
        seconds = self.wall_seconds - self.compile_seconds
        return self.output_tokens / seconds if seconds > 0 else None


class _HostReader:
    """Device->host reads of step outputs: through pinned buffers and events on CUDA (a ring, one
    buffer per step in flight), a plain read on CPU. `shape` is the widest output (K drafts); a step
    of k < K drafts (auto's plain and shorter steps) is narrower, and is staged in the first
    rows x cols elements of a buffer, a contiguous view: a copy into a strided view of pinned memory
    (the top-left corner of a [B, K] buffer) would go through pageable memory and block the host,
    so the lagged loop would stop overlapping (GPU_NOTES 3). `ring=True` on CPU runs the CUDA path's
    buffer logic with plain buffers (tests)."""

    def __init__(self, device: torch.device, shape: tuple[int, int], depth: int,
                 ring: bool | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.ring = self.cuda if ring is None else ring
        if self.ring:
            self.buffers = [torch.empty(shape[0] * shape[1], dtype=torch.long, pin_memory=self.cuda)
                            for _ in range(depth)]
            self.events = [torch.cuda.Event() if self.cuda else None for _ in range(depth)]
        self.turn = 0

    def start(self, out: torch.Tensor) -> Callable[[], list[list[int]]]:
        if not self.ring:
            return lambda: out.tolist()
        i = self.turn = (self.turn + 1) % len(self.buffers)
        buffer = self.staging(i, out.shape[0], out.shape[1])
        buffer.copy_(out, non_blocking=self.cuda)
        event = self.events[i]
        if event is not None:
            event.record()

        def read() -> list[list[int]]:
            if event is not None:
                event.synchronize()
            return buffer.tolist()

        return read

    def staging(self, i: int, rows: int, cols: int) -> torch.Tensor:
        """Buffer i's first rows x cols elements as a contiguous [rows, cols] tensor."""
        return self.buffers[i][: rows * cols].view(rows, cols)


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
        # a draft the grammar refuses gives way to the tokens the grammar forces (structured/grammar.py)
        self.jump_forward = jump_forward
        self._grammars: dict[int, SlotGrammar] = {}      # the structured slots' states, by slot
        if grammar is not None and jump_forward and (step.host_drafts or (step.draft is None and step.k > 0)):
            # where the host drafts (no draft model, suffix drafting, a hybrid), the grammar's forced
            # tokens are proposals too (drafts/forced.py)
            proposer = ForcedProposer(self._grammars, proposer)
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
        self.state = step.new_state(batch_size, device, dtype)
        self.lag = int(device.type == "cuda" if overlap is None else overlap)
        if proposer is not None or grammar is not None:
            # a step's host drafts, and its rows' token masks, need the previous step's tokens:
            # issued once it is read
            self.lag = 0
        kind = "cuda" if device.type == "cuda" else "cpu"
        self.prefill_chunk = prefill_chunk or PREFILL_CHUNK[kind]
        self.prefill_budget = max(prefill_budget or PREFILL_BUDGET[kind], self.prefill_chunk)
        # on CPU each prompt is prefilled alone, its keys bounded by its own length: its cache and
        # first token are then the same bits whoever shares its admission (pipelines/prefill.py)
        self.prefill_alone = kind == "cpu"
        self.functions = StepFunctions(step, self.state, self.caches, sampling, device=device,
                                       compile=compile)
        self._compiled = self.functions.compiled
        # per token of a step's output: 1 column, and the packed logprobs when asked for
        self.lp_width = step.logprobs.width if step.logprobs is not None else 0
        self.reader = _HostReader(device, (batch_size, step.k + 4 + (step.k + 2) * self.lp_width), self.lag + 1)
        self.warmed = False
        self._prepared: list = []             # the policies warm_up has prepared
        self.step_no = 0
        self.width = batch_size       # slots the step runs over (fewer in a run's tail, see _narrow)
        # positions each slot's draft has not absorbed yet (a bound: the draft's catch-up window)
        self.gaps = [0] * batch_size
        # slots whose draft did not read their prompt (the policy had ruled drafting out: see
        # `keeps_draft_state`): their drafts are worth nothing, their gaps are not kept
        self.cold: set[int] = set()
        self.last_k = 0               # k of the last step issued
        self.totals = RunTotals(spec=SpecCounters(step.k))  # live: readable after an interrupt
        self._prompt_logprobs: dict[int, list[dict | None]] = {}   # by slot, filled by the prefill
        # the token masks' host copy: [B, K+1, W] int32, all allowed outside structured slots
        self._host_masks = (torch.full(tuple(self.state.token_masks.shape), -1, dtype=torch.int32)
                            if self.state.token_masks is not None else None)

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

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Compile (and capture) what the run needs up front; seconds spent. Idempotent. A fixed k gets
        its variant compiled (its draft and the verify of k + 1 rows); an adaptive policy gets the
        plain step, every variant's step time (measured or estimated, profile.py) and the variant it
        expects to use where the job repays compiling it; host proposals' `auto` gets the plain step
        and K's estimated cost (host_policy.py). A hybrid's parts are prepared each as alone. A policy
        swapped in later (`use_policy`) is prepared the same way."""
        seconds = 0.0
        # a policy may stand behind a wrapper that shares its decisions (parallel/decisions.py:
        # `inner`); the wrapper is what is called, the policy inside is what it is
        kind = lambda p: getattr(p, "inner", p)  # noqa: E731
        hybrid = kind(self.policy) if isinstance(kind(self.policy), HybridPolicy) else None
        policy = hybrid.model if hybrid is not None else self.policy
        if not self.warmed:
            self.warmed = True
            batches = []
            if self.compiled and self.functions.prefill_compiled:
                # The variants a run meets: one row and several rows (dynamic shapes specialise on 1).
                # Their limit 0 leaves the slots inactive.
                items = [PrefillItem(b, [0] * 3, 0, 0) for b in range(min(2, self.batch_size))]
                for rows in sorted({1, len(items)}):
                    call = plan_prefill(items[:rows], chunk=self.prefill_chunk, budget=self.prefill_budget)[0]
                    key_index = self.functions.key_index(self.kv_bucket(call.width))
                    batches.append(pack(call, self.alloc_len, key_index, self.device))
            # a fixed k > 0 never runs the plain step; an adaptive policy starts from it (profile.py)
            seconds += self._compile_variant(policy.k if isinstance(kind(policy), FixedPolicy) else 0, batches)
        if any(p is self.policy for p in self._prepared):
            host = hybrid.host if hybrid is not None and hybrid.adaptive else policy
            if isinstance(kind(host), HostDraftPolicy) and host.estimated:
                seconds += refresh_host(host, self.functions, self.kv_bucket(0), self.batch_size)
            return seconds
        self._prepared.append(self.policy)
        if isinstance(kind(policy), AdaptivePolicy):
            from specgen.pipelines.profile import calibrate

            spent = calibrate(policy, self.functions, self.kv_bucket(0), self.batch_size)
            seconds += spent if self.compiled else 0.0     # eager: profiling is part of the run
        if isinstance(kind(policy), HostDraftPolicy) or (hybrid is not None and hybrid.adaptive):
            from specgen.pipelines.profile import MIN_COMPILE_SECONDS, cold_compile_seconds

            cold = max(cold_compile_seconds(self.functions, ("verify", 1)), MIN_COMPILE_SECONDS)
            host = hybrid.host if hybrid is not None else policy
            spent = profile_host(host, self.functions, self.kv_bucket(0), self.batch_size, cold)
            seconds += spent if self.compiled else 0.0
        if isinstance(kind(policy), FixedPolicy):
            k = policy.k
            if not (self.functions.verify_ready(1) if k == 0 else k in self.functions.compiled_ks):
                seconds += self._compile_variant(k, [])
        return seconds

    def _compile_variant(self, k: int, prefill_batches: list) -> float:
        """Compile variant k before the run (k = 0: the plain step; with host drafts alone a fixed k
        runs plain steps too, wherever no slot has a proposal; a hybrid's fixed k runs the verify of
        its host drafts alone too, wherever every slot takes them); seconds spent."""
        return self.functions.warm_up(self.kv_bucket(0), prefill_batches, (k,) if k else (),
                                      plain=not k or (self.proposer is not None and not self.hybrid),
                                      verifies=(k + 1,) if k and self.hybrid else ())

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
        self._grammars.clear()
        self.cold.clear()
        if self._host_masks is not None:                # ... and structured slots' mask rows
            self._host_masks.fill_(-1)
            self.state.token_masks.fill_(-1)
        if self.width != self.batch_size:               # a previous run ended narrowed
            self.width = self.batch_size
            self.functions.use_slots(self.batch_size)
        totals.k_steps = [0] * (self.unified.k + 1)
        slots: list[_Slot | None] = [None] * self.batch_size
        lengths = [0] * self.batch_size          # host mirror of cache_lens, for the kv bucket
        # (step number, k, each slot's host drafts or None, the read of its output)
        inflight: deque[tuple[int, int, dict | None, Callable[[], list[list[int]]]]] = deque()
        more = True
        while True:
            free = [b for b in range(self.batch_size) if slots[b] is None]
            if free and more:
                more = self._admit(free, pending, slots, lengths, finish, totals)
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

    def _issue(self, live: list[int], slots: list[_Slot | None], lengths: list[int], inflight,
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
        if self.proposer is not None:
            k, drafted, host_only = self._host_drafts(live, k)
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
            out = functions.step(kv_len, window, k, between=self._write_masks if self._grammars else None)
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
        """The token masks of the k + 1 rows each structured slot verifies: row i allows what its
        grammar allows after the committed tokens and the drafts before row i (read from `pending`,
        after the draft and before the verify). Other slots' rows allow everything: every host row
        is copied, in one transfer, so a slot without a grammar must have all-allowed host rows (reset
        on release, moved with its slot by `_narrow`, set at admission)."""
        if not self._grammars:
            return
        start = time.perf_counter()
        drafts = self.state.pending[:, 1:k + 1].tolist() if k else None
        host = self._host_masks
        # forced tokens replace refused drafts only where the drafts are argmax choices: a stochastic
        # draft's token must be the one its stored distribution q sampled
        jump = self.jump_forward and self.state.draft_probs is None
        totals = self.totals
        for b, grammar in self._grammars.items():
            walk = grammar.fill(host[b, :k + 1], drafts[b] if k else [], jump_forward=jump)
            if walk.written:
                self.state.pending[b, 1:k + 1].copy_(torch.tensor(walk.drafts))
            totals.grammar_drafts += walk.written
            totals.refused_drafts += walk.refused
        self.state.token_masks[:, :k + 1].copy_(host[:, :k + 1], non_blocking=True)
        totals.mask_seconds += time.perf_counter() - start

    def _host_drafts(self, live: list[int], k: int) -> tuple[int, dict[int, int], bool]:
        """The host's proposals for the live slots, and what the step does with them. Without a draft
        model: the policy's k for them (0: a plain step), written into `pending[:, 1:k+1]` (a shorter
        one padded: its extra rows are verified like any draft, and a pad the target happens to
        choose is kept, losslessly). A hybrid's plan (hybrid_policy.py) may do the same (host_only),
        or run the model's step of k drafts with some slots' rows replaced by their proposals
        (`host_drafts` / `host_use`, merged inside the compiled step). Returns k, how many tokens
        each slot's drafts hold, and whether the step is the host's alone."""
        if not self.hybrid:
            if k == 0:
                return 0, {}, False
            proposals = {b: self.proposer.propose(b, k) for b in live}
            k = self.policy.choose_host(proposals, self.width, self.functions.compiled_ks, self.compiled)
            if k == 0:
                return 0, {}, False
            self.state.pending[:, 1:k + 1].copy_(self._block(proposals, k, k))
            return k, {b: min(k, len(p)) for b, p in proposals.items()}, True
        proposals = {b: self.proposer.propose(b, self.unified.k) for b in live}
        ready = {j for j in range(1, self.unified.k + 1) if self.functions.verify_ready(j + 1)}
        plan = self.policy.decide(k, proposals, self.width, ready, self.compiled, self.functions.compiled_ks)
        k = plan.k
        if k == 0:
            return 0, {}, False
        used = {b: p for b, p in proposals.items() if b in plan.use}
        if plan.host_only:
            self.state.pending[:, 1:k + 1].copy_(self._block(used, k, k))
        else:
            self.state.host_drafts.copy_(self._block(used, k, self.unified.k))
            self.state.host_use.copy_(torch.tensor([b in plan.use for b in range(self.batch_size)]))
        return k, {b: min(k, len(used[b])) if b in used else 0 if plan.host_only else k for b in live}, plan.host_only

    def _block(self, proposals: dict, k: int, width: int) -> torch.Tensor:
        """[B, width] int64: each slot's first k proposed tokens, padded with 0."""
        block = [[0] * width for _ in range(self.batch_size)]
        for b, proposal in proposals.items():
            block[b][: min(k, len(proposal))] = proposal.tokens[:k]
        return torch.tensor(block)

    def _narrow(self, slots: list[_Slot | None], lengths: list[int]) -> None:
        """In the tail of a run (no request left to admit), once at most half the slots are live,
        move them to the lowest slots and step over those only: on CPU a step costs in proportion to
        its rows. Only for eager steps without a step in flight (a compiled step keeps its shape,
        and results in flight name the old slots)."""
        live = [b for b in range(self.width) if slots[b] is not None]
        if self.compiled or self.lag or not live or len(live) > self.width // 2:
            return
        width = 1 << (len(live) - 1).bit_length()          # a power of two: few distinct shapes
        free = [b for b in range(width) if slots[b] is None]
        moved = [(b, free.pop(0)) for b in live if b >= width]
        tensors = (*self.state.tensors(), *self.caches.tensors(), *self.sampling.tensors())
        for src, dst in moved:
            for t in tensors:
                t[dst] = t[src]
            self.state.active[src] = False
            slots[dst], slots[src] = slots[src], None
            lengths[dst] = lengths[src]
            self.gaps[dst] = self.gaps[src]
            if src in self.cold:
                self.cold.discard(src)
                self.cold.add(dst)
            if src in self._grammars:
                self._grammars[dst] = self._grammars.pop(src)
            if self._host_masks is not None:
                # every moved slot's rows move with it (the device's moved above), structured or not:
                # `dst` may hold the rows of a finished structured request (issue 68)
                self._host_masks[dst] = self._host_masks[src]
                self._free_masks(src)
            self.policy.move(src, dst)
            if self.proposer is not None:
                self.proposer.move(src, dst)
        self.width = width
        self.functions.use_slots(width)

    def _absorb(self, number: int, k: int, drafted: dict[int, int] | None, rows: list[list[int]],
                slots: list[_Slot | None], lengths: list[int], finish) -> None:
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
                if self._finishes(slot, last, in_grammar=True):
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
                if self._finishes(slot, token):
                    self._release(b, slots, finish)
                    break

    def _finishes(self, slot: _Slot, token: int, in_grammar: bool = False) -> bool:
        """Add a committed token to the request's output (and, unless `in_grammar`, its grammar); True
        when it ends it: a stop (EOS, a stop string), its length, or its grammar's end."""
        grammar = slot.grammar
        # a token the grammar refuses (never one the masks allowed; the first token was taken at
        # admission, where a refusal set `slot.error`) is the request's error: loud, never silent
        refused = grammar is not None and (slot.error is not None if in_grammar else not grammar.advance(token))
        if refused:
            slot.tracker.token_ids.append(token)
            slot.tracker.finish_reason = "error"
            slot.error = slot.error or f"structured output: the grammar refused committed token {token} (a specgen bug)"
            return True
        if slot.tracker.add(token):
            return True
        if grammar is not None and grammar.finished:
            slot.tracker.finish_reason = "stop"
            return True
        return False

    def _logprobs(self, row: list[int], k: int, i: int, token: int) -> dict:
        """The record entry of emitted token i (-1: the first token, sampled by the prefill) of a slot's
        output row from a step of k drafts (layout: pipelines/unified.py)."""
        start = 3 + (k + 1) + (i + 1) * self.lp_width
        return unpack(row[start:start + self.lp_width], token, self.unified.logprobs.top)

    def _release(self, b: int, slots: list[_Slot | None], finish) -> None:
        finish(self._completion(slots[b]))
        slots[b] = None
        self._grammars.pop(b, None)
        self.cold.discard(b)
        self._free_masks(b)
        if self.proposer is not None:
            self.proposer.finish(b)
        # The device would stop the slot only at its length limit; a stop string or EOS ends it here
        # (queued behind any step already in flight, which then runs it once more, harmlessly).
        self.state.active[b] = False

    def _free_masks(self, b: int) -> None:
        """Slot b holds no grammar: its rows allow everything, on the host (`_write_masks` copies
        every slot's host rows) and on the device."""
        if self._host_masks is not None:
            self._host_masks[b].fill_(-1)
            self.state.token_masks[b].fill_(-1)

    # -- admission ------------------------------------------------------------------------------------

    def _admit(self, free: list[int], pending: Iterator[Request], slots: list[_Slot | None],
               lengths: list[int], finish, totals: RunTotals) -> bool:
        """Prefill the next runnable requests into the free slots; False once requests run out."""
        admitted: list[tuple[int, Request]] = []
        more = True
        while len(admitted) < len(free):
            request = next(pending, None)
            if request is None:
                more = False
                break
            error = request.error or self._check_prompt(request)
            if error is None and request.response_format is not None and self.grammar is None:
                error = "response_format: this runner was built without structured output"
            if error is not None:
                finish(Completion(request.id, [], "", "error", len(request.prompt_ids), None, error))
                continue
            admitted.append((free[len(admitted)], request))
        if not admitted:
            return more
        starts = {b: start_state(r.prompt_ids[r.generation_start:], self.reasoning)
                  if self.reasoning is not None else None for b, r in admitted}
        grammars, bad = self._start_grammars(admitted, starts)
        for b, request in admitted:
            if b in bad:
                finish(Completion(request.id, [], "", "error", len(request.prompt_ids), None, bad[b]))
        admitted = [(b, r) for b, r in admitted if b not in bad]
        if not admitted:
            return more
        # the draft reads each prompt unless the policy has ruled drafting out (a pass over every
        # prompt position, paid whether the job drafts or not): asked prompt by prompt, as the
        # policy may want one slot warm
        cold = set()
        if self.unified.draft is not None:
            warm = sum(1 for b, slot in enumerate(slots) if slot is not None and b not in self.cold)
            for b, _ in admitted:
                if self.policy.keeps_draft_state(warm):
                    warm += 1
                else:
                    cold.add(b)
        failed = self._prefill(admitted, starts, cold)
        for b, request in admitted:
            if b in failed:
                finish(Completion(request.id, [], "", "error", len(request.prompt_ids), None, failed[b]))
                continue
            slots[b] = _Slot(request, OutputTracker(self.rules, self._max_tokens(request)),
                             SpecCounters(self.unified.k), first_step=self.step_no, reasoning_start=starts[b],
                             logprobs=[] if self.lp_width else None,
                             prompt_logprobs=self._prompt_logprobs.pop(b, None), grammar=grammars.get(b))
            if b in grammars:
                # the first token (the prefill's) reaches the host with the slot's first step, but that
                # step's rows are masked after it: read it now (structured runs have no lag anyway)
                first = int(self.state.pending[b, 0])
                if not grammars[b].advance(first):
                    slots[b].error = f"structured output: the grammar refused the first token {first} (a specgen bug)"
                self._grammars[b] = grammars[b]
            lengths[b] = len(request.prompt_ids)
            self.gaps[b] = 0 if b in cold else 1    # the draft re-reads the prompt's last position
            if b in cold:
                self.cold.add(b)
                totals.unabsorbed_prompts += 1
            else:
                self.cold.discard(b)
            self.policy.admit(b)
            if self.proposer is not None:
                self.proposer.admit(b, request.prompt_ids)
            totals.prompt_tokens += len(request.prompt_ids)
        return more

    def _start_grammars(self, admitted: list[tuple[int, Request]], starts: dict[int, bool | None]
                        ) -> tuple[dict[int, SlotGrammar], dict[int, str]]:
        """Each admitted request's grammar state (those with a response_format), and the row-0 mask
        its first token is sampled under (the prefill's); every other admitted slot's rows allow
        everything. Returns the states and {slot: error} for formats that do not compile."""
        if self._host_masks is None:
            return {}, {}
        grammars, bad = {}, {}
        closes = self.reasoning.closes if self.reasoning is not None else ()
        for b, request in admitted:
            self._host_masks[b].fill_(-1)
            if request.response_format is None:
                continue
            try:
                grammar = self.grammar.matcher(request.response_format, closes, thinking=starts[b] is True)
            except GrammarError as err:
                bad[b] = str(err)
                continue
            grammar.fill(self._host_masks[b, :1], [])
            grammars[b] = grammar
        for b, _ in admitted:
            self.state.token_masks[b].copy_(self._host_masks[b])
        return grammars, bad

    def _prefill(self, admitted: list[tuple[int, Request]], starts: dict[int, bool | None],
                 cold: set[int] | None = None) -> dict[int, str]:
        """Run the batched prefill; on a failure, retry each request alone so that only the bad one
        fails. Returns {slot: error} for the requests that could not be prefilled. `cold`: the slots
        whose prompts the draft does not read (updated: `_prefill_items`)."""
        # an unknown start state (no marker in the prompt) is verified as content: strictly
        items = {b: PrefillItem(b, r.prompt_ids, self.noise_key(r), len(r.prompt_ids) + self._max_tokens(r) - 1,
                                reasoning=starts[b] is True)
                 for b, r in admitted}
        try:
            self._prefill_items(list(items.values()), cold)
            return {}
        except Exception as exc:  # one bad prompt never kills the batch: find it
            if len(items) == 1:
                failures = {next(iter(items)): exc}
            else:
                failures = {}
                for b, item in items.items():
                    try:
                        self._prefill_items([item], cold)
                    except Exception as exc_alone:
                        failures[b] = exc_alone
        for b in failures:
            self.state.active[b] = False
            self._prompt_logprobs.pop(b, None)
        return {b: f"prefill failed: {type(e).__name__}: {e}" for b, e in failures.items()}

    def _prefill_items(self, items: list[PrefillItem], cold: set[int] | None = None) -> None:
        """Prefill `items`; the draft reads every prompt but those of `cold` (a call absorbs where any
        of its prompts does: they then leave `cold`)."""
        cold = cold if cold is not None else set()
        top = self.unified.prompt_logprobs
        if top is not None:
            for item in items:
                self._prompt_logprobs[item.slot] = [None] * len(item.prompt)
        for call in plan_prefill(items, chunk=self.prefill_chunk, budget=self.prefill_budget,
                                 alone=self.prefill_alone):
            end = call.start + call.width
            bound = (min(-(-end // CPU_KV_GRANULE) * CPU_KV_GRANULE, self.alloc_len - 1) if self.prefill_alone
                     else self.kv_bucket(end))
            key_index = self.functions.key_index(bound)
            batch = pack(call, self.alloc_len, key_index, self.device)
            absorb = any(item.slot not in cold for item in call.items)
            if absorb:
                cold.difference_update(item.slot for item in call.items)
            hidden = self.functions.prefill(batch, absorb)
            self.totals.prefill_calls += 1
            if hidden is None:
                continue
            # entry j of a row: the prompt token at position start + j + 1 (a device->host read of
            # each prefill call: with prompt logprobs only)
            wanted = [max(0, min(call.chunk, len(item.prompt) - call.start - 1)) for item in call.items]
            packed = self.unified.prompt_logprobs_of(hidden, batch.next_tokens, wanted)
            for item, rows in zip(call.items, packed):
                out = self._prompt_logprobs[item.slot]
                for j, row in enumerate(rows.tolist()):
                    out[call.start + j + 1] = unpack(row, item.prompt[call.start + j + 1], top)

    def _max_tokens(self, request: Request) -> int:
        return min(request.max_tokens, self.max_seq_len - len(request.prompt_ids))

    def _check_prompt(self, request: Request) -> str | None:
        if not request.prompt_ids:
            return "the prompt is empty after tokenisation"
        if len(request.prompt_ids) >= self.max_seq_len:
            return (f"the prompt has {len(request.prompt_ids)} tokens; runtime.max_seq_len "
                    f"({self.max_seq_len}) leaves no room to generate")
        # on the host, before any kernel reads it: an id outside the embedding is an index error on
        # CPU but a device-side assert on CUDA, which ends the process and every request in it
        vocab = self.unified.target.vocab_size
        if 0 <= min(request.prompt_ids) and max(request.prompt_ids) < vocab:
            return None
        for position, token in enumerate(request.prompt_ids):
            if not 0 <= token < vocab:
                return (f"prompt token {position} has id {token}, outside the target's vocabulary "
                        f"(0..{vocab - 1})")
        return None

    def noise_key(self, request: Request) -> int:
        return noise_key_for(self.seed, request.request_key)

    def _completion(self, slot: _Slot) -> Completion:
        t = slot.tracker
        completion = Completion(slot.request.id, list(t.token_ids), "", t.finish_reason,
                                len(slot.request.prompt_ids), slot.counters, logprobs=slot.logprobs,
                                prompt_logprobs=slot.prompt_logprobs, error=slot.error)
        parts = split(t.token_ids, self.reasoning, slot.reasoning_start) if self.reasoning is not None else None
        if parts is None or (not parts.reasoning and len(parts.content) == len(t.token_ids)):
            completion.text = t.final_text()     # no reasoning and no marker: the text as decoded
            return completion
        decode = self.rules.decode
        reasoning, text = decode(parts.reasoning), decode(parts.content)
        if t.text is not None:
            # A stop string ended the request: it ends in the part that took the last token, so that
            # part is cut (searched near its end only: it was completed by the last token).
            tail = len(decode(t.token_ids[-2:])) + max(map(len, self.rules.stop_strings))
            if parts.ends_in_reasoning:
                reasoning = cut_at_stop(reasoning, self.rules.stop_strings, len(reasoning) - tail)
            else:
                text = cut_at_stop(text, self.rules.stop_strings, len(text) - tail)
        completion.text = text
        completion.reasoning_text = reasoning if parts.reasoning else None
        completion.num_reasoning_tokens = len(parts.reasoning)
        return completion
