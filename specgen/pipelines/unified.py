"""THE STEP: merge -> target -> verify -> commit -> draft, one function with static shapes.

Contract (DESIGN.md section 3). Device state, all static in shape, `B` slots, `K` drafts per step:
- `pending [B, K+1]`: the last committed token (its K/V not yet written) then the K drafts;
- `cache_lens [B]`: tokens whose K/V are in the caches; pending token i sits at `cache_lens + i`;
- `draft_probs [B, K, V] | None`: the draft distributions of `pending[:, 1:]` (stochastic drafts only);
- the target's and the draft's KV caches (mutated in place; entries past `cache_lens` are scratch).

`step(...)` returns the next `pending`, `cache_lens`, `draft_probs`, and `emitted [B, K+1]` (accepted
drafts then the correction / bonus token, padded with -1) and `accepted [B]`, the only two tensors the
host reads. Inactive slots run along (static shapes) but never advance. Plain decoding is the same
step with K = 0 and no draft. Prefill of a new request (`prefill_slot`) runs outside the step: it
writes the prompt's K/V, samples the first token with the same keyed sampler, and drafts the first
block, leaving the slot exactly as a step would have.

Noise positions: logits row i predicts the token at `cache_lens + i + 1`; that absolute position keys
its randomness, so the token sampled there never depends on the batch, the draft, or call order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.pipelines.verify import verify
from specgen.sampling import SamplingTensors, process_logits, sample_draft


@dataclass(slots=True)
class StepState:
    pending: torch.Tensor           # [B, K+1] int64
    cache_lens: torch.Tensor        # [B] int64
    draft_probs: torch.Tensor | None  # [B, K, V] float32, stochastic drafts only
    active: torch.Tensor            # [B] bool
    noise_key: torch.Tensor         # [B] int64


class UnifiedStep:
    """Binds a target and an optional draft into the step and the slot prefill."""

    def __init__(self, target, draft=None, *, stochastic_drafts: bool = False) -> None:
        self.target = target
        self.draft = draft
        self.k = draft.num_speculative_tokens if draft is not None else 0
        self.stochastic = stochastic_drafts and draft is not None
        self.capture = tuple(draft.aux_layer_ids) if draft is not None else ()

    # -- state -------------------------------------------------------------------------------------

    def new_state(self, slots: int, device) -> StepState:
        probs = (torch.zeros(slots, self.k, self.target.vocab_size, device=device)
                 if self.stochastic else None)
        return StepState(
            pending=torch.zeros(slots, self.k + 1, dtype=torch.long, device=device),
            cache_lens=torch.zeros(slots, dtype=torch.long, device=device),
            draft_probs=probs,
            active=torch.zeros(slots, dtype=torch.bool, device=device),
            noise_key=torch.zeros(slots, dtype=torch.long, device=device),
        )

    def scratch_len(self) -> int:
        """Cache entries past the last committed token a step may write (target K+1, draft chain)."""
        return 2 * self.k + 2

    # -- the step ------------------------------------------------------------------------------------

    def _pick(self, sampling: SamplingTensors, noise_key: torch.Tensor):
        if not self.stochastic:
            return lambda logits, position: (logits.argmax(-1), None)

        def pick(logits: torch.Tensor, position: torch.Tensor):
            # Drafts are processed exactly like the target (same temperature / top-k / top-p / min-p).
            logprobs = process_logits(logits.unsqueeze(1), sampling)[:, 0]
            return sample_draft(logprobs, sampling.greedy, noise_key, position)

        return pick

    def step(self, pending, cache_lens, draft_probs, active, noise_key, sampling: SamplingTensors,
             target_cache, draft_cache, kv_len: int):
        # pending: [B, K+1]; cache_lens, active, noise_key: [B]; draft_probs: [B, K, V] | None
        k = self.k
        offsets = torch.arange(k + 1, device=pending.device)
        positions = cache_lens.unsqueeze(1) + offsets                        # [B, K+1]
        # merge + target: one forward over the last token and the drafts of every slot
        logits, aux = self.target(pending, positions, target_cache, kv_len, capture=self.capture)
        # verify: the one lossless rule for every draft type
        logprobs = process_logits(logits, sampling)
        accepted, emitted = verify(logprobs, pending[:, 1:], draft_probs, sampling.greedy, noise_key,
                                   positions + 1, all_greedy=sampling.all_greedy)
        # commit: rejected positions need no undo, their K/V lie past the new length
        new_lens = cache_lens + (accepted + 1) * active
        last = emitted.gather(1, accepted.unsqueeze(1))                      # [B, 1]
        if self.draft is None:
            return last, new_lens, None, emitted, accepted
        # draft: entry j pairs the feature of position p_j with the token at p_j + 1
        next_tokens = emitted.clamp(min=0)
        drafts, probs = self.draft.propose(aux, next_tokens, positions, accepted, draft_cache, kv_len,
                                           self._pick(sampling, noise_key))
        return torch.cat((last, drafts), 1), new_lens, probs, emitted, accepted

    # -- prefill (outside the compiled step) ---------------------------------------------------------

    def prefill_slot(self, state: StepState, slot: int, prompt: torch.Tensor, noise_key: int,
                     sampling: SamplingTensors, target_cache, draft_cache, kv_len: int) -> int:
        """Write `prompt [P]` into `slot`, sample its first token, draft its first block; returns the
        first token (read by the host: this is the one sync of the prefill)."""
        device = state.pending.device
        rows = torch.tensor([slot], device=device)
        tokens = prompt.view(1, -1).to(device)
        length = tokens.shape[1]
        positions = torch.arange(length, device=device).unsqueeze(0)
        row_sampling = sampling.select(rows)
        key = torch.tensor([noise_key], dtype=torch.long, device=device)
        logits, aux = self.target(tokens, positions, target_cache, kv_len, slots=rows,
                                  logits_from=length - 1, capture=self.capture)
        logprobs = process_logits(logits, row_sampling)
        _, emitted = verify(logprobs, tokens[:, :0], None, row_sampling.greedy, key,
                            torch.tensor([[length]], device=device), all_greedy=sampling.all_greedy)
        first = emitted[:, :1]                                              # [1, 1]
        pending = first
        if self.draft is not None:
            next_tokens = torch.cat((tokens[:, 1:], first), 1)
            last_index = torch.tensor([length - 1], device=device)
            drafts, probs = self.draft.propose(aux, next_tokens, positions, last_index, draft_cache,
                                               kv_len, self._pick(row_sampling, key), slots=rows)
            pending = torch.cat((first, drafts), 1)
            if probs is not None:
                state.draft_probs[slot] = probs[0]
        state.pending[slot] = pending[0]
        state.cache_lens[slot] = length
        state.noise_key[slot] = noise_key
        state.active[slot] = True
        return int(first)
