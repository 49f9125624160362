"""THE STEP: merge -> target -> verify -> commit -> draft, one function with static shapes; and prefill.

Contract (DESIGN.md section 3). Device state lives in one `StepState` (all static in shape, `B` slots,
`K` drafts per step) and the caches in `StepCaches`:
- `pending [B, K+1]`: the last committed token (its K/V not yet written) then the K drafts;
- `cache_lens [B]`: tokens whose K/V are in the caches; pending token i sits at `cache_lens + i`;
- `active [B]`: slots that advance; a slot stops by itself once `cache_lens >= limit` (its
  max_tokens), so a step issued before the host has seen a finish can never run past the allocation;
- `limit [B]`, `noise_key [B]`, and `draft_probs [B, K, V] | None` (stochastic drafts only);
- `reasoning [B]`: whether the slot is inside a reasoning span before `pending[:, 0]`. Prefill sets
  it from the prompt; the step reads and updates it only with relaxed acceptance, which applies
  inside spans alone (pipelines/relaxed.py).

`step(state, caches, sampling, key_index)` advances every active slot by one verified block, updates
`state` IN PLACE (fixed addresses: CUDA graphs replay them) and returns one int64 tensor
`[B, K+4]` = (accepted, relaxed_accepted, the last committed token the step started from,
emitted[K+1]), the only thing the host reads. `emitted` holds the accepted drafts then the
correction / bonus token, padded with -1; `relaxed_accepted` counts the accepted drafts that only
relaxed acceptance accepted (0 without it).
Inactive slots run along (static shapes), compute at positions 0..K of their own rows (scratch), and
never advance. Plain decoding is the same step with K = 0 and no draft.

`prefill(state, caches, batch, sampling)` writes the prompts of several slots at once (a
`PrefillBatch`: padded rows, per-row positions, possibly one chunk of a longer prompt); for rows whose
prompt ends in this chunk it samples the first token with the same keyed sampler, drafts the first
block and activates the slot, leaving it exactly as a step would have. It returns nothing: the first
token reaches the host as the "last committed token" of the slot's first step, so prefill adds no
device->host read.

Noise positions: logits row i predicts the token at `cache_lens + i + 1`; that absolute position keys
its randomness, so the token sampled there never depends on the batch, the draft, or call order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.models.attention import AttentionBatch
from specgen.pipelines.reasoning import states_after
from specgen.pipelines.relaxed import RelaxedAcceptance
from specgen.pipelines.verify import verify
from specgen.sampling import SamplingTensors, process_logits, sample_draft


@dataclass(slots=True)
class StepState:
    pending: torch.Tensor             # [B, K+1] int64
    cache_lens: torch.Tensor          # [B] int64
    active: torch.Tensor              # [B] bool
    limit: torch.Tensor               # [B] int64: the slot stops once cache_lens >= limit
    noise_key: torch.Tensor           # [B] int64
    reasoning: torch.Tensor           # [B] bool: inside a reasoning span before pending[:, 0]
    draft_probs: torch.Tensor | None  # [B, K, V] float32, stochastic drafts only

    def _fields(self) -> tuple[torch.Tensor | None, ...]:
        return (self.pending, self.cache_lens, self.active, self.limit, self.noise_key, self.reasoning,
                self.draft_probs)

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
    """Binds a target and an optional draft into the step and the batched prefill. `relaxed`:
    relaxed acceptance inside reasoning spans (lossy, opt-in; pipelines/relaxed.py)."""

    def __init__(self, target, draft=None, *, stochastic_drafts: bool = False, use_kernel: bool = False,
                 num_sms: int = 1, relaxed: RelaxedAcceptance | None = None) -> None:
        self.target = target
        self.draft = draft
        self.k = draft.num_speculative_tokens if draft is not None else 0
        self.stochastic = stochastic_drafts and draft is not None
        self.relaxed = relaxed if self.k > 0 else None
        self.capture = tuple(draft.aux_layer_ids) if draft is not None else ()
        self.use_kernel = use_kernel      # the Triton attention kernel (CUDA) or the SDPA reference
        self.num_sms = num_sms
        self.timer = None                 # a pipelines.phases.PhaseTimer (eager steps only)

    # -- state -------------------------------------------------------------------------------------

    def new_state(self, slots: int, device) -> StepState:
        probs = (torch.zeros(slots, self.k, self.target.vocab_size, device=device)
                 if self.stochastic else None)
        zeros = torch.zeros(slots, dtype=torch.long, device=device)
        flags = torch.zeros(slots, dtype=torch.bool, device=device)
        return StepState(pending=torch.zeros(slots, self.k + 1, dtype=torch.long, device=device),
                         cache_lens=zeros.clone(), active=flags.clone(), limit=zeros.clone(),
                         noise_key=zeros.clone(), reasoning=flags.clone(), draft_probs=probs)

    def new_caches(self, slots: int, max_len: int, dtype: torch.dtype, device) -> StepCaches:
        draft = self.draft.new_cache(slots, max_len, dtype, device) if self.draft is not None else None
        return StepCaches(self.target.new_cache(slots, max_len, dtype, device), draft)

    def scratch_len(self) -> int:
        """Cache entries past the last committed token a step may write (target K+1, draft chain)."""
        return 2 * self.k + 2

    def attention(self, positions: torch.Tensor, rows: torch.Tensor | None,
                  key_index: torch.Tensor) -> AttentionBatch:
        # Only the step splits long rows over several kernel programs: its shapes are static, and a
        # prefill call has programs enough (and dynamic shapes under torch.compile).
        return AttentionBatch.build(positions, rows, key_index, self.use_kernel,
                                    self.num_sms if rows is None else 1)

    def _pick(self, sampling: SamplingTensors, noise_key: torch.Tensor):
        if not self.stochastic:
            return lambda logits, position: (logits.argmax(-1), None)

        def pick(logits: torch.Tensor, position: torch.Tensor):
            # Drafts are processed exactly like the target (same temperature / top-k / top-p / min-p).
            logprobs = process_logits(logits.unsqueeze(1), sampling)[:, 0]
            return sample_draft(logprobs, sampling.greedy, noise_key, position)

        return pick

    # -- the step ------------------------------------------------------------------------------------

    def step(self, state: StepState, caches: StepCaches, sampling: SamplingTensors,
             key_index: torch.Tensor) -> torch.Tensor:
        # state: B slots; key_index: [kv_len] -> [B, K+4] int64 (accepted, relaxed, last, emitted[K+1])
        timer = self.timer
        if timer is not None:
            timer.begin()
        k, active = self.k, state.active
        offsets = torch.arange(k + 1, device=active.device)
        positions = torch.where(active, state.cache_lens, 0).unsqueeze(1) + offsets     # [B, K+1]
        attn = self.attention(positions, None, key_index)
        # merge + target: one forward over the last token and the drafts of every slot
        hidden, aux = self.target(state.pending, positions, caches.target, attn, capture=self.capture)
        logits = self.target.logits(hidden)
        if timer is not None:
            timer.mark("target")
        logprobs = process_logits(logits, sampling)
        relaxed = inside = None
        if self.relaxed is not None:
            # inside[:, i]: the row is in a reasoning span once pending[:, 0..i] are committed, i.e.
            # where pending[:, i + 1] = drafts[:, i] (verified by logits row i) would go
            inside = states_after(state.pending, state.reasoning, self.relaxed.markers)   # [B, K+1]
            relaxed = self.relaxed.mask(logprobs, state.pending[:, 1:], inside[:, :k])
        # verify: the one lossless rule for every draft type (relaxed acceptance aside)
        accepted, emitted, relaxed_accepted = verify(
            logprobs, state.pending[:, 1:], state.draft_probs, sampling.greedy, state.noise_key,
            positions + 1, relaxed=relaxed, all_greedy=sampling.all_greedy)
        out = torch.cat((accepted.unsqueeze(1), relaxed_accepted.unsqueeze(1), state.pending[:, :1], emitted), 1)
        # commit: rejected positions need no undo, their K/V lie past the new length
        new_lens = state.cache_lens + (accepted + 1) * active
        pending = emitted.gather(1, accepted.unsqueeze(1))                              # [B, 1]
        if timer is not None:
            timer.mark("verify")
        if self.draft is not None:
            # draft: entry j pairs the feature of position p_j with the token at p_j + 1
            drafts, probs = self.draft.propose(aux, emitted.clamp(min=0), positions, accepted,
                                               caches.draft, attn, self._pick(sampling, state.noise_key))
            pending = torch.cat((pending, drafts), 1)
            if probs is not None:
                state.draft_probs.copy_(probs)
        state.pending.copy_(pending)
        if inside is not None:
            state.reasoning.copy_(inside.gather(1, accepted.unsqueeze(1)).squeeze(1))
        state.cache_lens.copy_(new_lens)
        state.active.copy_(active & (new_lens < state.limit))
        if timer is not None:
            timer.mark("draft")
        return out

    # -- prefill -------------------------------------------------------------------------------------

    def prefill(self, state: StepState, caches: StepCaches, batch: PrefillBatch,
                sampling: SamplingTensors) -> None:
        # batch: n rows of T tokens; updates the rows' state in place (only rows with is_last finish)
        if self.timer is not None:
            self.timer.begin(is_step=False)
        rows, last = batch.rows, batch.last_index
        n = rows.shape[0]
        index = torch.arange(n, device=rows.device)
        attn = self.attention(batch.positions, rows, batch.key_index)
        hidden, aux = self.target(batch.tokens, batch.positions, caches.target, attn, capture=self.capture)
        row_sampling = sampling.select(rows)
        length = batch.positions[index, last] + 1                                       # [n]
        logprobs = process_logits(self.target.logits(hidden[index, last].unsqueeze(1)), row_sampling)
        _, emitted, _ = verify(logprobs, batch.tokens[:, :0], None, row_sampling.greedy, batch.noise_key,
                               length.unsqueeze(1), all_greedy=sampling.all_greedy)
        first = emitted[:, :1]                                                          # [n, 1]
        pending, probs = first, None
        if self.draft is not None:
            # the entry of the chunk's last token pairs it with the token after it: the next prompt
            # token for a chunk that ends mid-prompt, the sampled first token otherwise
            after = torch.where(batch.is_last, first[:, 0], batch.next_tokens[index, last])
            next_tokens = batch.next_tokens.scatter(1, last.unsqueeze(1), after.unsqueeze(1))
            drafts, probs = self.draft.propose(aux, next_tokens, batch.positions, last, caches.draft,
                                               attn, self._pick(row_sampling, batch.noise_key))
            pending = torch.cat((first, drafts), 1)
        done = batch.is_last
        state.pending[rows] = torch.where(done.unsqueeze(1), pending, state.pending[rows])
        state.cache_lens[rows] = torch.where(done, length, state.cache_lens[rows])
        state.limit[rows] = batch.limit
        state.noise_key[rows] = batch.noise_key
        state.reasoning[rows] = torch.where(done, batch.reasoning, state.reasoning[rows])
        state.active[rows] = done & (length < batch.limit)
        if probs is not None:
            state.draft_probs[rows] = torch.where(done[:, None, None], probs, state.draft_probs[rows])
        if self.timer is not None:
            self.timer.mark("prefill")
