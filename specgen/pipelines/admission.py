"""Admitting requests into free slots: the checks before a prompt is read, and its prefill.

Contract: `Prefill(unified, functions, ...)` owns how prompts are prefilled: in chunks of `chunk`
tokens and calls of at most `budget` padded tokens (pipelines/prefill.py plans them), each prompt
alone on CPU (its keys bounded by its own length: its cache and first token are then the same bits
whoever shares its admission), and the prompt logprobs it computes on the way (`logprobs_of`).
- `check(request)`: why a prompt cannot run (empty, no room left to generate, an id outside the
  target's vocabulary: checked on the host, where an index error on CUDA would be a device-side
  assert that ends the process and every request in it), or None.
- `max_tokens(request)`: what it may still generate within `max_seq_len`.
- `run(admitted, starts, cold)`: one batched prefill of the admitted requests; on a failure each is
  retried alone, so that only the bad one fails. Returns {slot: error}. `cold`: the slots whose
  prompts the draft does not read (a call absorbs where any of its prompts does: they then leave
  `cold`).
`admit(runner, free, ...)` is the loop's admission: the next requests into the free slots (a request
that cannot run is an error completion at once), their reasoning start states and grammars, which
prompts the draft reads (the policy may have ruled drafting out), the prefill, and each slot's set-up
(its output tracker, counters, the policy's and the host proposer's view of it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from specgen.pipelines.logprobs import unpack
from specgen.pipelines.prefill import PrefillItem, pack, plan_prefill
from specgen.pipelines.reasoning import start_state
from specgen.pipelines.requests import Completion, Request, RunTotals, Slot
from specgen.pipelines.stats import SpecCounters
from specgen.pipelines.stops import OutputTracker

# Prefill: prompt tokens per chunk, and padded tokens per call (bounds activation memory).
PREFILL_CHUNK = {"cpu": 512, "cuda": 2048}
PREFILL_BUDGET = {"cpu": 4096, "cuda": 16384}
CPU_KV_GRANULE = 64


class Prefill:
    def __init__(self, unified, functions, state, *, device, alloc_len: int, max_seq_len: int,
                 kv_bucket: Callable[[int], int], noise_key: Callable[[Request], int],
                 on_call: Callable[[], None] = lambda: None, chunk: int | None = None,
                 budget: int | None = None) -> None:
        kind = "cuda" if device.type == "cuda" else "cpu"
        self.unified, self.functions, self.state, self.device = unified, functions, state, device
        self.alloc_len, self.max_seq_len = alloc_len, max_seq_len
        self.kv_bucket, self.noise_key = kv_bucket, noise_key
        self.on_call = on_call                                     # after each prefill call (its count)
        self.chunk = chunk or PREFILL_CHUNK[kind]
        self.budget = max(budget or PREFILL_BUDGET[kind], self.chunk)
        self.alone = kind == "cpu"
        self._prompt_logprobs: dict[int, list[dict | None]] = {}   # by slot, until its slot takes them

    def max_tokens(self, request: Request) -> int:
        return min(request.max_tokens, self.max_seq_len - len(request.prompt_ids))

    def check(self, request: Request) -> str | None:
        if not request.prompt_ids:
            return "the prompt is empty after tokenisation"
        if len(request.prompt_ids) >= self.max_seq_len:
            return (f"the prompt has {len(request.prompt_ids)} tokens; runtime.max_seq_len "
                    f"({self.max_seq_len}) leaves no room to generate")
        vocab = self.unified.target.vocab_size
        if 0 <= min(request.prompt_ids) and max(request.prompt_ids) < vocab:
            return None
        for position, token in enumerate(request.prompt_ids):
            if not 0 <= token < vocab:
                return (f"prompt token {position} has id {token}, outside the target's vocabulary "
                        f"(0..{vocab - 1})")
        return None

    def logprobs_of(self, b: int) -> list[dict | None] | None:
        """Slot b's prompt logprobs (prompt_logprobs on), handed over once."""
        return self._prompt_logprobs.pop(b, None)

    def run(self, admitted: list[tuple[int, Request]], starts: dict[int, bool | None],
            cold: set[int] | None = None) -> dict[int, str]:
        # an unknown start state (no marker in the prompt) is verified as content: strictly
        items = {b: PrefillItem(b, r.prompt_ids, self.noise_key(r), len(r.prompt_ids) + self.max_tokens(r) - 1,
                                reasoning=starts[b] is True)
                 for b, r in admitted}
        try:
            self.items(list(items.values()), cold)
            return {}
        except Exception as exc:  # one bad prompt never kills the batch: find it
            if len(items) == 1:
                failures = {next(iter(items)): exc}
            else:
                failures = {}
                for b, item in items.items():
                    try:
                        self.items([item], cold)
                    except Exception as exc_alone:
                        failures[b] = exc_alone
        for b in failures:
            self.state.active[b] = False
            self._prompt_logprobs.pop(b, None)
        return {b: f"prefill failed: {type(e).__name__}: {e}" for b, e in failures.items()}

    def items(self, items: list[PrefillItem], cold: set[int] | None = None) -> None:
        """Prefill `items`; the draft reads every prompt but those of `cold`."""
        cold = cold if cold is not None else set()
        top = self.unified.prompt_logprobs
        if top is not None:
            for item in items:
                self._prompt_logprobs[item.slot] = [None] * len(item.prompt)
        for call in plan_prefill(items, chunk=self.chunk, budget=self.budget, alone=self.alone):
            end = call.start + call.width
            bound = (min(-(-end // CPU_KV_GRANULE) * CPU_KV_GRANULE, self.alloc_len - 1) if self.alone
                     else self.kv_bucket(end))
            key_index = self.functions.key_index(bound)
            batch = pack(call, self.alloc_len, key_index, self.device)
            absorb = any(item.slot not in cold for item in call.items)
            if absorb:
                cold.difference_update(item.slot for item in call.items)
            hidden = self.functions.prefill(batch, absorb)
            self.on_call()
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


def admit(runner, free: list[int], pending: Iterator[Request], slots: list[Slot | None],
          lengths: list[int], finish, totals: RunTotals) -> bool:
    """Prefill `runner`'s next runnable requests into its `free` slots; False once requests run out."""
    admitted: list[tuple[int, Request]] = []
    more = True
    while len(admitted) < len(free):
        request = next(pending, None)
        if request is None:
            more = False
            break
        error = request.error or runner.prefill.check(request)
        if error is None and request.response_format is not None and runner.grammar is None:
            error = "response_format: this runner was built without structured output"
        if error is not None:
            finish(Completion(request.id, [], "", "error", len(request.prompt_ids), None, error))
            continue
        admitted.append((free[len(admitted)], request))
    if not admitted:
        return more
    starts = {b: start_state(r.prompt_ids[r.generation_start:], runner.reasoning)
              if runner.reasoning is not None else None for b, r in admitted}
    closes = runner.reasoning.closes if runner.reasoning is not None else ()
    grammars, bad = runner.grammars.start(admitted, starts, closes) if runner.grammars is not None else ({}, {})
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
    if runner.unified.draft is not None:
        warm = sum(1 for b, slot in enumerate(slots) if slot is not None and b not in runner.cold)
        for b, _ in admitted:
            if runner.policy.keeps_draft_state(warm):
                warm += 1
            else:
                cold.add(b)
    failed = runner.prefill.run(admitted, starts, cold)
    for b, request in admitted:
        if b in failed:
            finish(Completion(request.id, [], "", "error", len(request.prompt_ids), None, failed[b]))
            continue
        slots[b] = Slot(request, OutputTracker(runner.rules, runner.prefill.max_tokens(request)),
                        SpecCounters(runner.unified.k), first_step=runner.step_no, reasoning_start=starts[b],
                        logprobs=[] if runner.lp_width else None,
                        prompt_logprobs=runner.prefill.logprobs_of(b), grammar=grammars.get(b))
        if b in grammars:
            # the prefill's first token, read now (structured runs have no lag anyway)
            slots[b].error = runner.grammars.take(b, grammars[b], int(runner.state.pending[b, 0]))
        lengths[b] = len(request.prompt_ids)
        runner.gaps[b] = 0 if b in cold else 1    # the draft re-reads the prompt's last position
        if b in cold:
            runner.cold.add(b)
            totals.unabsorbed_prompts += 1
        else:
            runner.cold.discard(b)
        runner.policy.admit(b)
        if runner.proposer is not None:
            runner.proposer.admit(b, request.prompt_ids)
        totals.prompt_tokens += len(request.prompt_ids)
    return more
