"""The batch loop: continuous batching around the unified step.

Contract: `Runner.run(requests, on_finish, on_progress)` pushes every request through the step and
calls `on_finish(Completion)` exactly once per request, in finishing order, errors included (a request
that fails never stops the others). It owns slot refill (prefill of a new request happens outside the
compiled step), the host side of each step (ONE device->host read of `accepted`/`emitted` per step),
stop / EOS / max_tokens handling, and per-request acceptance counters. It knows nothing of files,
recipes or terminals: progress goes to a callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from specgen.kernels.keyed_noise import noise_key_for
from specgen.pipelines.stats import SpecCounters
from specgen.pipelines.stops import OutputTracker, StopRules
from specgen.pipelines.unified import UnifiedStep
from specgen.sampling import SamplingTensors

MIN_KV_BUCKET = 256


@dataclass(slots=True)
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    request_key: int                 # position-keyed noise depends on (seed, request_key, position)
    error: str | None = None         # a request that failed before generation (bad line, tokenizer)


@dataclass(slots=True)
class Completion:
    id: str
    token_ids: list[int]
    text: str
    finish_reason: str               # stop | length | error
    num_prompt_tokens: int
    spec: SpecCounters | None
    error: str | None = None


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


@dataclass(slots=True)
class RunTotals:
    requests: int = 0
    errors: int = 0
    output_tokens: int = 0
    steps: int = 0
    wall_seconds: float = 0.0
    spec: SpecCounters = field(default_factory=lambda: SpecCounters(0))

    @property
    def tokens_per_second(self) -> float | None:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else None


class Runner:
    def __init__(self, step: UnifiedStep, *, batch_size: int, max_seq_len: int, rules: StopRules,
                 sampling: SamplingTensors, seed: int, device: torch.device, dtype: torch.dtype,
                 compile: bool = False) -> None:
        self.unified = step
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.rules = rules
        self.sampling = sampling
        self.seed = seed
        self.device = device
        self.alloc_len = max_seq_len + step.scratch_len()
        self.target_cache = step.target.new_cache(batch_size, self.alloc_len, dtype, device)
        self.draft_cache = (step.draft.new_cache(batch_size, self.alloc_len, dtype, device)
                            if step.draft is not None else None)
        self.state = step.new_state(batch_size, device)
        self.totals = RunTotals(spec=SpecCounters(step.k))  # live: readable after an interrupt
        self.step_fn = step.step
        if compile:
            import torch._inductor.config as inductor_config

            # Weights never change during a run: let Inductor fold them in as constants (on CPU this
            # also prepacks them for oneDNN, ~1.4x at batch 8).
            inductor_config.freezing = True
            # One compiled variant per (runner, kv bucket): several runners in one process (tests,
            # benchmarks, library users) would otherwise hit Dynamo's default limit of 8 per function.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            mode = None
            if device.type == "cuda":
                # CUDA graphs replay fixed addresses: the caches the step writes must be static inputs.
                mode = "reduce-overhead"
                for cache in (self.target_cache, self.draft_cache):
                    for t in (cache.k + cache.v) if cache is not None else ():
                        torch._dynamo.mark_static_address(t)
            self.step_fn = torch.compile(step.step, mode=mode, fullgraph=True, dynamic=False)

    def kv_bucket(self, longest: int) -> int:
        """Keys attended per step: a power of two covering every slot, so compiled variants are few."""
        need = longest + self.unified.scratch_len()
        bucket = MIN_KV_BUCKET
        while bucket < need:
            bucket *= 2
        return min(bucket, self.alloc_len)

    # -- the loop -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, requests: Iterable[Request], on_finish: Callable[[Completion], None],
            on_progress: Callable[[Progress], None] | None = None) -> RunTotals:
        totals = self.totals = RunTotals(spec=SpecCounters(self.unified.k))
        slots: list[_Slot | None] = [None] * self.batch_size
        lengths = [0] * self.batch_size          # host mirror of cache_lens, for the kv bucket
        pending = iter(requests)
        start = time.perf_counter()

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
            self._loop(slots, lengths, pending, finish, totals)
        finally:
            totals.wall_seconds = time.perf_counter() - start
        return totals

    def _loop(self, slots, lengths, pending, finish, totals: RunTotals) -> None:
        while True:
            for b in range(self.batch_size):
                if slots[b] is None:
                    slots[b] = self._admit(b, pending, finish, lengths)
            live = [b for b in range(self.batch_size) if slots[b] is not None]
            if not live:
                break
            kv_len = self.kv_bucket(max(lengths[b] for b in live))
            s = self.state
            out = self.step_fn(s.pending, s.cache_lens, s.draft_probs, s.active, s.noise_key,
                               self.sampling, self.target_cache, self.draft_cache, kv_len)
            s.pending, s.cache_lens, s.draft_probs = self._own(out[0]), self._own(out[1]), self._own(out[2])
            emitted, accepted = out[3], out[4]
            host = torch.cat((accepted.unsqueeze(1), emitted), 1).cpu().tolist()  # the one sync
            totals.steps += 1
            for b in live:
                slot = slots[b]
                n_accepted = host[b][0]
                slot.counters.record(n_accepted)
                lengths[b] += n_accepted + 1
                for token in host[b][1: n_accepted + 2]:
                    if slot.tracker.add(token):
                        finish(self._completion(slot))
                        self._release(b, slots)
                        break

    def _own(self, t: torch.Tensor | None) -> torch.Tensor | None:
        # CUDA-graph outputs live in buffers the next replay overwrites; state must not alias them.
        return t.clone() if t is not None and t.device.type == "cuda" else t

    def _admit(self, b: int, pending: Iterator[Request], finish, lengths: list[int]) -> _Slot | None:
        """Prefill the next runnable request into slot b; requests that fail are finished as errors."""
        for request in pending:
            error = request.error or self._check_prompt(request)
            if error is None:
                try:
                    slot = self._prefill(b, request)
                except Exception as exc:  # one bad prompt never kills the batch
                    error = f"prefill failed: {type(exc).__name__}: {exc}"
                    self.state.active[b] = False
            if error is not None:
                finish(Completion(request.id, [], "", "error", len(request.prompt_ids), None, error))
                continue
            lengths[b] = len(request.prompt_ids)
            if slot.tracker.finish_reason is not None:      # finished by its first token
                finish(self._completion(slot))
                self.state.active[b] = False
                continue
            return slot
        return None

    def _check_prompt(self, request: Request) -> str | None:
        if not request.prompt_ids:
            return "the prompt is empty after tokenisation"
        if len(request.prompt_ids) >= self.max_seq_len:
            return (f"the prompt has {len(request.prompt_ids)} tokens; runtime.max_seq_len "
                    f"({self.max_seq_len}) leaves no room to generate")
        return None

    def _prefill(self, b: int, request: Request) -> _Slot:
        room = self.max_seq_len - len(request.prompt_ids)
        tracker = OutputTracker(self.rules, max_tokens=min(request.max_tokens, room))
        slot = _Slot(request, tracker, SpecCounters(self.unified.k))
        prompt = torch.tensor(request.prompt_ids, dtype=torch.long)
        kv_len = self.kv_bucket(len(request.prompt_ids))
        first = self.unified.prefill_slot(self.state, b, prompt, self.noise_key(request),
                                          self.sampling, self.target_cache, self.draft_cache, kv_len)
        tracker.add(first)
        return slot

    def noise_key(self, request: Request) -> int:
        return noise_key_for(self.seed, request.request_key)

    def _release(self, b: int, slots: list[_Slot | None]) -> None:
        slots[b] = None
        self.state.active[b] = False

    def _completion(self, slot: _Slot) -> Completion:
        t = slot.tracker
        return Completion(slot.request.id, list(t.token_ids), t.final_text(), t.finish_reason,
                          len(slot.request.prompt_ids), slot.counters)
