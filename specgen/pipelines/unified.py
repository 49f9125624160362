"""THE STEP, in two compiled parts issued back to back (draft, then verify), and prefill.

Contract (DESIGN.md sections 3 and 7). Device state lives in one `StepState` (static shapes: `B` slots,
`K` = the draft's most tokens per step, K_max) and the caches in `StepCaches`:
- `pending [B, K+1]`: the last committed token (its K/V not yet written) then the drafts;
- `cache_lens [B]`: tokens whose K/V are in the caches; pending token i sits at `cache_lens + i`;
- `active [B]`: slots that advance; a slot stops by itself once `cache_lens >= limit` (its
  max_tokens), so a step issued before the host has seen a finish can never run past the allocation;
- `limit [B]`, `noise_key [B]`, and `draft_probs [B, K, V] | None` (stochastic drafts only);
- `reasoning [B]`: whether the slot is inside a reasoning span before `pending[:, 0]`. Prefill sets
  it from the prompt; the step reads and updates it only with relaxed acceptance, which applies
  inside spans alone (pipelines/relaxed.py);
- with a draft: `draft_len [B]`, the positions the draft has absorbed (its cache holds entries for
  positions < draft_len), and a ring of the last `ring_len` positions: `features [B, R, D]` (the
  target features the draft reads, by position % R) and `tokens [B, R]` (the committed tokens);
- a hybrid (a draft model and host proposals, `host_drafts=True`): `host_drafts [B, K]` and
  `host_use [B]`, written by the host before a step: the slots marked take the host's proposal
  instead of the model's block (the draft still runs for every slot: it keeps absorbing).
- structured output (`structured=True`): `token_masks [B, K+1, W]`, the tokens the grammar allows at
  each verified row (specgen/structured/masks.py), written by the host after the draft and before
  the verify (and row 0 before a prefill, for the first token); an unconstrained slot's rows allow
  everything. The draft proposes freely: a draft the grammar refuses is rejected at its own row.

One step = `draft(k)` then `verify(T = k + 1)`; the host picks k per step (pipelines/policy.py):
- `verify(state, caches, sampling, key_index, rows)`: merge -> target -> verify -> commit over the
  first T = len(rows) pending tokens (the last committed token and T - 1 drafts). `rows` is an
  arange whose LENGTH is T: ONE compiled function serves every T (a dynamic size). T = 1 is plain
  decoding, the very function `draft.method: none` runs (with a draft it also keeps the ring current:
  a copy of T feature rows). It updates `state` IN PLACE (fixed addresses: CUDA graphs replay
  them) and returns one int64 tensor `[B, T+3]` = (accepted, relaxed_accepted, the last committed
  token the step started from, emitted[T]), the only thing the host reads. `emitted` holds the
  accepted drafts then the correction / bonus token, padded with -1; `relaxed_accepted` counts the
  accepted drafts that only relaxed acceptance accepted (0 without it). With `logprobs` on, W =
  1 + 2N more columns follow for the first token (the prefill's; the host reads them at a
  request's first step) and W for each of the T emitted tokens (pipelines/logprobs.py).
- `draft(state, caches, sampling, key_index, window, k)`: the draft first absorbs every committed
  position since its last call (entries read from the ring: after a step of k drafts, the k + 1
  verified positions; after plain steps, all the positions they skipped), then proposes k tokens into
  `pending[:, 1:k+1]` (a hybrid's marked slots: the host's proposal instead, merged in the same
  graph). One compiled variant per k; `window` is an arange whose length W bounds the
  positions any slot has to absorb (a dynamic size). A slot never absorbs more than
  `max_window` positions back: the ring holds no more (before a step without the draft would
  leave a slot further behind, the runner has the draft absorb alone: `draft` with k = 0).
Inactive slots run along (static shapes), compute at their first positions (scratch), and never
advance. Rows past a slot's own gap in the draft window sit at its committed length (scratch).

`prefill(state, caches, batch, sampling)` writes the prompts of several slots at once (a
`PrefillBatch`: padded rows, per-row positions, possibly one chunk of a longer prompt); for rows whose
prompt ends in this chunk it samples the first token with the same keyed sampler, lets the draft
absorb the prompt (no proposal: the next `draft` call proposes, re-reading the prompt's last
position) and activates the slot. It returns nothing (with `prompt_logprobs`: the chunk's last hidden
states, which the host turns into prompt logprobs outside the step, `prompt_logprobs_of`): the first
token reaches the host as the "last committed token" of the slot's first step, so prefill adds no
device->host read.

Noise positions: logits row i predicts the token at `cache_lens + i + 1`; that absolute position keys
its randomness, so the token sampled there never depends on the batch, the draft, k, or call order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.models.attention import AttentionBatch
from specgen.pipelines.logprobs import Logprobs, logprob_view, pack, width
from specgen.pipelines.reasoning import states_after
from specgen.pipelines.relaxed import RelaxedAcceptance
from specgen.pipelines.verify import verify
from specgen.sampling import SamplingTensors, process_logits, sample_draft
from specgen.structured.masks import apply_token_masks, mask_words


RING_MIN = 64     # ring positions at least (K_max + 1 + the longest catch-up)


@dataclass(slots=True)
class StepState:
    pending: torch.Tensor             # [B, K+1] int64
    cache_lens: torch.Tensor          # [B] int64
    active: torch.Tensor              # [B] bool
    limit: torch.Tensor               # [B] int64: the slot stops once cache_lens >= limit
    noise_key: torch.Tensor           # [B] int64
    reasoning: torch.Tensor           # [B] bool: inside a reasoning span before pending[:, 0]
    draft_probs: torch.Tensor | None  # [B, K, V] float32, stochastic drafts only
    draft_len: torch.Tensor | None = None   # [B] int64: positions the draft has absorbed
    features: torch.Tensor | None = None    # [B, R, D] target features by position % R
    tokens: torch.Tensor | None = None      # [B, R] int64 committed tokens by position % R
    host_drafts: torch.Tensor | None = None  # [B, K] int64: a hybrid's host proposals (written before a step)
    host_use: torch.Tensor | None = None     # [B] bool: ... and the slots that take them over the model's
    first_logprobs: torch.Tensor | None = None  # [B, W] int64: the first token's packed logprobs (prefill's)
    token_masks: torch.Tensor | None = None     # [B, K+1, Wm] int32: each row's allowed tokens (structured)

    def _fields(self) -> tuple[torch.Tensor | None, ...]:
        return (self.pending, self.cache_lens, self.active, self.limit, self.noise_key, self.reasoning,
                self.draft_probs, self.draft_len, self.features, self.tokens, self.host_drafts, self.host_use,
                self.first_logprobs, self.token_masks)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self._fields() if t is not None]

    def narrow(self, slots: int) -> StepState:
        """The first `slots` slots, sharing storage."""
        return StepState(*(t[:slots] if t is not None else None for t in self._fields()))


@dataclass(slots=True)
class StepCaches:
    target: object                    # the target's Cache
    draft: object | None              # the draft's Cache (None without a draft)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.target.tensors(), *(self.draft.tensors() if self.draft is not None else ())]

    def narrow(self, slots: int) -> StepCaches:
        return StepCaches(self.target.narrow(slots),
                          self.draft.narrow(slots) if self.draft is not None else None)


@dataclass(slots=True)
class PrefillBatch:
    """n rows of one prefill call, padded to T. Built on the host (pipelines/prefill.py)."""

    rows: torch.Tensor          # [n] int64 slots
    tokens: torch.Tensor        # [n, T] int64 prompt tokens of this chunk (0 = padding)
    positions: torch.Tensor     # [n, T] int64 absolute positions
    next_tokens: torch.Tensor   # [n, T] int64 token at position + 1 (its last prompt entry: filled here)
    last_index: torch.Tensor    # [n] int64 index of the chunk's last real token
    is_last: torch.Tensor       # [n] bool: the prompt ends in this chunk
    noise_key: torch.Tensor     # [n] int64
    limit: torch.Tensor         # [n] int64
    reasoning: torch.Tensor     # [n] bool: the prompt leaves the output inside a reasoning span
    key_index: torch.Tensor     # [kv_len] arange (reference attention's key bound)


class UnifiedStep:
    """Binds a target and an optional draft into the step's two parts and the batched prefill.
    `relaxed`: relaxed acceptance inside reasoning spans (lossy, opt-in; pipelines/relaxed.py)."""

    def __init__(self, target, draft=None, *, stochastic_drafts: bool = False, use_kernel: bool = False,
                 num_sms: int = 1, relaxed: RelaxedAcceptance | None = None, host_k: int = 0,
                 host_drafts: bool = False, logprobs: Logprobs | None = None,
                 prompt_logprobs: int | None = None, structured: bool = False) -> None:
        self.target = target
        # structured output (specgen/structured): token masks the host writes before each verify
        # (and before a prefill), applied to the target's logits of every row; off, the graphs are
        # the unconstrained ones
        self.structured = structured
        # the target's logprobs of each emitted token (pipelines/logprobs.py), packed into the output,
        # and of each prompt token with its top `prompt_logprobs` (returned by the prefill)
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.draft = draft
        # K_max. `host_k`: without a draft model, the host writes up to host_k drafts into `pending`
        # before each verify (drafts/suffix.py); the step never knows where its drafts came from.
        self.k = draft.num_speculative_tokens if draft is not None else host_k
        # beside a draft model (a hybrid), per slot and step: the model's block or the host's proposal
        self.host_drafts = host_drafts and draft is not None
        assert not (self.host_drafts and stochastic_drafts), "host proposals carry no distribution"
        self.stochastic = stochastic_drafts and draft is not None
        self.relaxed = relaxed if draft is not None else None
        self.capture = tuple(draft.aux_layer_ids) if draft is not None else ()
        # A draft may run in another dtype than the target (drafts/precision.py): what it reads (the
        # ring of target features) and its cache are kept in its own.
        self.draft_dtype = _floating_dtype(draft) if draft is not None else None
        self.use_kernel = use_kernel      # the Triton attention kernel (CUDA) or the SDPA reference
        self.num_sms = num_sms
        self.timer = None                 # a pipelines.phases.PhaseTimer (eager steps only)
        # The ring keeps the last ring_len positions; a verify writes up to K scratch entries past
        # the committed length, which alias the oldest ones, so a catch-up reads at most max_window.
        self.ring_len = max(RING_MIN, 4 * (self.k + 1))
        self.max_window = self.ring_len - self.k - 1

    # -- state -------------------------------------------------------------------------------------

    def new_state(self, slots: int, device, dtype: torch.dtype = torch.float32) -> StepState:
        probs = (torch.zeros(slots, self.k, self.target.vocab_size, device=device)
                 if self.stochastic else None)
        zeros = torch.zeros(slots, dtype=torch.long, device=device)
        flags = torch.zeros(slots, dtype=torch.bool, device=device)
        optional = {}
        if self.draft is not None:
            width = len(self.capture) * self.target.hidden_size
            optional = {"draft_len": zeros.clone(),
                        "features": torch.zeros(slots, self.ring_len, width, dtype=self.draft_dtype or dtype,
                                                device=device),
                        "tokens": torch.zeros(slots, self.ring_len, dtype=torch.long, device=device)}
        if self.host_drafts:
            optional.update(host_drafts=torch.zeros(slots, self.k, dtype=torch.long, device=device),
                            host_use=flags.clone())
        if self.logprobs is not None:
            optional["first_logprobs"] = torch.zeros(slots, self.logprobs.width, dtype=torch.long, device=device)
        if self.structured:
            optional["token_masks"] = torch.full((slots, self.k + 1, mask_words(self.target.vocab_size)), -1,
                                                 dtype=torch.int32, device=device)
        return StepState(pending=torch.zeros(slots, self.k + 1, dtype=torch.long, device=device),
                         cache_lens=zeros.clone(), active=flags.clone(), limit=zeros.clone(),
                         noise_key=zeros.clone(), reasoning=flags.clone(), draft_probs=probs, **optional)

    def new_caches(self, slots: int, max_len: int, dtype: torch.dtype, device) -> StepCaches:
        draft = (self.draft.new_cache(slots, max_len, self.draft_dtype or dtype, device)
                 if self.draft is not None else None)
        return StepCaches(self.target.new_cache(slots, max_len, dtype, device), draft)

    def scratch_len(self, k: int | None = None) -> int:
        """Cache entries past the last committed token a step of k drafts (default K) may write
        (target k+1, draft chain)."""
        return 2 * (self.k if k is None else k) + 2

    def attention(self, positions: torch.Tensor, rows: torch.Tensor | None,
                  key_index: torch.Tensor) -> AttentionBatch:
        # Only the step splits long rows over several kernel programs: its shapes are static, and a
        # prefill call has programs enough (and dynamic shapes under torch.compile).
        # The step's rows (rows is None) attend row-invariantly: a verified token's logits are the
        # same bits as plain decoding's. The prefill, shared by both, keeps SDPA.
        return AttentionBatch.build(positions, rows, key_index, self.use_kernel,
                                    self.num_sms if rows is None else 1, row_invariant=rows is None)

    def _pick(self, sampling: SamplingTensors, noise_key: torch.Tensor):
        if not self.stochastic:
            return lambda logits, position: (logits.argmax(-1), None)

        def pick(logits: torch.Tensor, position: torch.Tensor):
            # Drafts are processed exactly like the target (same temperature / top-k / top-p / min-p).
            logprobs = process_logits(logits.unsqueeze(1), sampling)[:, 0]
            return sample_draft(logprobs, sampling.greedy, noise_key, position)

        return pick

    # -- the step: draft, then verify ----------------------------------------------------------------

    def draft_block(self, state: StepState, caches: StepCaches, sampling: SamplingTensors,
                    key_index: torch.Tensor, window: torch.Tensor, k: int) -> None:
        # window: [W] arange (W >= every slot's unabsorbed positions); k: drafts to propose (static)
        timer = self.timer
        if timer is not None:
            timer.begin(is_step=False)
        active, ring = state.active, self.ring_len
        lens = torch.where(active, state.cache_lens, 1)                                  # [B]
        start = torch.maximum(torch.where(active, state.draft_len, 0), lens - window.shape[0])
        last = lens - 1 - start                                                          # [B] < W
        # entry j: the feature of position p_j and the token at p_j + 1; rows past a slot's gap sit
        # at its committed length, a scratch entry the next step overwrites
        positions = torch.minimum(start.unsqueeze(1) + window, lens.unsqueeze(1))       # [B, W]
        at = positions % ring
        features = state.features.gather(1, at.unsqueeze(-1).expand(-1, -1, state.features.shape[-1]))
        next_tokens = state.tokens.gather(1, (positions + 1) % ring)
        attn = self.attention(positions, None, key_index)
        drafts, probs = self.draft.propose(features, next_tokens, positions, last, caches.draft, attn,
                                           self._pick(sampling, state.noise_key), k)
        if state.host_use is not None:
            drafts = torch.where(state.host_use.unsqueeze(1), state.host_drafts[:, :k], drafts)
        state.pending[:, 1:k + 1].copy_(drafts)
        if probs is not None:
            state.draft_probs[:, :k].copy_(probs)
        state.draft_len.copy_(torch.where(active, lens, state.draft_len))
        if timer is not None:
            timer.mark("draft")

    def verify_block(self, state: StepState, caches: StepCaches, sampling: SamplingTensors,
                     key_index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # rows: [T] arange, T = 1 + drafts verified; key_index: [kv_len]
        # -> [B, T+3] int64 (accepted, relaxed, last, emitted[T])
        timer = self.timer
        if timer is not None:
            timer.begin()
        t, active = rows.shape[0], state.active
        positions = torch.where(active, state.cache_lens, 0).unsqueeze(1) + rows          # [B, T]
        # gathered, not sliced: the commit below writes pending[:, 0] in place, and a view of T
        # columns that may or may not overlap that write would specialise the compiled step on T
        pending = state.pending.index_select(1, rows)                                    # [B, T]
        attn = self.attention(positions, None, key_index)
        # merge + target: one forward over the last token and the drafts of every slot
        hidden, aux = self.target(pending, positions, caches.target, attn, capture=self.capture)
        logits = self.target.logits(hidden)
        if state.token_masks is not None:
            # row i: the tokens the grammar allows after pending[:, :i + 1] (the bonus row included)
            logits = apply_token_masks(logits, state.token_masks.index_select(1, rows))
        if timer is not None:
            timer.mark("target")
        logprobs = process_logits(logits, sampling)
        drafts = pending[:, 1:]
        relaxed = inside = None
        if self.relaxed is not None:
            # inside[:, i]: the row is in a reasoning span once pending[:, 0..i] are committed, i.e.
            # where pending[:, i + 1] = drafts[:, i] (verified by logits row i) would go
            inside = states_after(pending, state.reasoning, self.relaxed.markers)           # [B, T]
            relaxed = self.relaxed.mask(logprobs, drafts, inside[:, :-1])
        draft_probs = state.draft_probs.index_select(1, rows[1:] - 1) if state.draft_probs is not None else None
        # verify: the one lossless rule for every draft type (relaxed acceptance aside)
        accepted, emitted, relaxed_accepted = verify(
            logprobs, drafts, draft_probs, sampling.greedy, state.noise_key, positions + 1,
            relaxed=relaxed, all_greedy=sampling.all_greedy)
        out = torch.cat((accepted.unsqueeze(1), relaxed_accepted.unsqueeze(1), pending[:, :1], emitted), 1)
        if self.logprobs is not None:
            # ... then the first token's (read at a request's first step only) and each emitted token's
            view = logprob_view(logits, logprobs, sampling, self.logprobs.mode)
            packed = pack(view, emitted.clamp(min=0), self.logprobs.top)               # [B, T, W]
            out = torch.cat((out, state.first_logprobs, packed.flatten(1)), 1)
        # commit: rejected positions need no undo, their K/V lie past the new length
        new_lens = state.cache_lens + (accepted + 1) * active
        if self.draft is not None:
            # the ring: the T features, and the tokens at positions p .. p + T (the committed ones
            # first, then scratch) that the draft reads when it next absorbs these positions
            self._write_ring(state, positions, aux, torch.cat((pending[:, :1], emitted.clamp(min=0)), 1))
        state.pending[:, :1].copy_(emitted.gather(1, accepted.unsqueeze(1)))
        if inside is not None:
            state.reasoning.copy_(inside.gather(1, accepted.unsqueeze(1)).squeeze(1))
        state.cache_lens.copy_(new_lens)
        state.active.copy_(active & (new_lens < state.limit))
        if timer is not None:
            timer.mark("verify")
        return out

    def _write_ring(self, state: StepState, positions: torch.Tensor, features: torch.Tensor,
                    tokens: torch.Tensor) -> None:
        # positions: [B, T]; features: [B, T, D] (position p's); tokens: [B, T+1] (positions p .. p+T)
        slots = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
        if features is not None:          # None: a draft that reads no target layer (test doubles)
            state.features.index_put_((slots, positions % self.ring_len), features.to(state.features.dtype))
        after = torch.cat((positions, positions[:, -1:] + 1), 1)
        state.tokens.index_put_((slots, after % self.ring_len), tokens)

    def step(self, state: StepState, caches: StepCaches, sampling: SamplingTensors,
             key_index: torch.Tensor, k: int | None = None) -> torch.Tensor:
        """One whole step, eagerly: draft k (default K_max; 0 = plain decoding), then verify. Without a
        draft model the k drafts are the ones the host wrote into `pending`."""
        k = self.k if k is None else k
        if k > 0 and self.draft is not None:
            window = torch.arange(self.max_window, device=state.pending.device)
            self.draft_block(state, caches, sampling, key_index, window, k)
        return self.verify_block(state, caches, sampling, key_index,
                                 torch.arange(k + 1, device=state.pending.device))

    # -- prefill -------------------------------------------------------------------------------------

    def prefill(self, state: StepState, caches: StepCaches, batch: PrefillBatch,
                sampling: SamplingTensors, absorb: bool = True) -> torch.Tensor | None:
        # batch: n rows of T tokens; updates the rows' state in place (only rows with is_last finish).
        # absorb: the draft reads the chunk (False: its cache is left as it is, the ring still kept)
        # -> None, or with prompt_logprobs the last layer's output [n, T, H] (prompt_logprobs_of)
        if self.timer is not None:
            self.timer.begin(is_step=False)
        rows, last = batch.rows, batch.last_index
        n = rows.shape[0]
        index = torch.arange(n, device=rows.device)
        attn = self.attention(batch.positions, rows, batch.key_index)
        hidden, aux = self.target(batch.tokens, batch.positions, caches.target, attn, capture=self.capture)
        row_sampling = sampling.select(rows)
        length = batch.positions[index, last] + 1                                       # [n]
        logits = self.target.logits(hidden[index, last].unsqueeze(1))                   # [n, 1, V]
        if state.token_masks is not None:     # the first token: the grammar's start (row 0, host-written)
            logits = apply_token_masks(logits, state.token_masks[rows, :1])
        logprobs = process_logits(logits, row_sampling)
        _, emitted, _ = verify(logprobs, batch.tokens[:, :0], None, row_sampling.greedy, batch.noise_key,
                               length.unsqueeze(1), all_greedy=sampling.all_greedy)
        first = emitted[:, 0]                                                           # [n]
        done = batch.is_last
        if self.logprobs is not None:
            view = logprob_view(logits, logprobs, row_sampling, self.logprobs.mode)
            packed = pack(view, emitted[:, :1], self.logprobs.top)[:, 0]              # [n, W]
            state.first_logprobs[rows] = torch.where(done[:, None], packed, state.first_logprobs[rows])
        if self.draft is not None:
            # the draft absorbs the chunk: the entry of its last token pairs it with the token after
            # it (the next prompt token mid-prompt, the sampled first token at the end); no proposal
            after = torch.where(done, first, batch.next_tokens[index, last])
            next_tokens = batch.next_tokens.scatter(1, last.unsqueeze(1), after.unsqueeze(1))
            features = aux.to(self.draft_dtype) if aux is not None and self.draft_dtype is not None else aux
            if absorb:
                self.draft.propose(features, next_tokens, batch.positions, last, caches.draft, attn,
                                   self._pick(row_sampling, batch.noise_key), 0)
            # the next draft call re-reads the prompt's last position from the ring, and proposes
            ring = self.ring_len
            where = (length - 1) % ring
            if aux is not None:
                state.features[rows, where] = torch.where(done[:, None], aux[index, last].to(state.features.dtype),
                                                          state.features[rows, where])
            state.tokens[rows, length % ring] = torch.where(done, first, state.tokens[rows, length % ring])
            state.draft_len[rows] = torch.where(done, length - 1, state.draft_len[rows])
        state.pending[rows, 0] = torch.where(done, first, state.pending[rows, 0])
        state.cache_lens[rows] = torch.where(done, length, state.cache_lens[rows])
        state.limit[rows] = batch.limit
        state.noise_key[rows] = batch.noise_key
        state.reasoning[rows] = torch.where(done, batch.reasoning, state.reasoning[rows])
        state.active[rows] = done & (length < batch.limit)
        if self.timer is not None:
            self.timer.mark("prefill")
        return hidden if self.prompt_logprobs is not None else None

    @torch.inference_mode()
    def prompt_logprobs_of(self, hidden: torch.Tensor, next_tokens: torch.Tensor, lengths: list[int],
                           rows_at_once: int = 1024) -> list[torch.Tensor]:
        """hidden: [n, T, H] (prefill's), next_tokens: [n, T], lengths: each row's entries wanted ->
        per row [length, W] int64: entry j holds the packed logprobs of next_tokens[r, j] (the prompt
        token after position j) under the model's own distribution (temperature 1, no filter, as
        vLLM's prompt logprobs). Eager and in slices of `rows_at_once` positions: the head over a
        whole prefill call (n * T * V floats) is more memory than the step ever holds."""
        out = []
        for r, length in enumerate(lengths):
            parts = []
            for start in range(0, length, rows_at_once):
                end = min(start + rows_at_once, length)
                logprobs = torch.log_softmax(self.target.logits(hidden[r, start:end].unsqueeze(0)).float(), -1)
                parts.append(pack(logprobs, next_tokens[r, start:end].unsqueeze(0), self.prompt_logprobs)[0])
            out.append(torch.cat(parts) if parts else next_tokens.new_zeros(0, width(self.prompt_logprobs)))
        return out


def _floating_dtype(module) -> torch.dtype | None:
    """The dtype of a module's first floating-point weight (None: it has none, a test double)."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return None
