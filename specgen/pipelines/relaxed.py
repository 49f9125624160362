"""Relaxed acceptance: LOSSY, opt-in, only inside reasoning spans (TensorRT-LLM's rule for DeepSeek-R1).

Contract: `RelaxedAcceptance.mask(logprobs, drafts, inside)` says which drafts may be accepted even
where the strict rule would reject them. `verify` then accepts those (`relaxed=`) and counts them
apart. A draft x proposed for verify row i qualifies when all of these hold:
- its row is inside a reasoning span: `inside[b, i]`, the state after pending tokens 0..i
  (`reasoning.states_after`). A `</think>` accepted earlier in the same block therefore makes the
  positions after it strict;
- the target ranks x among its `top_k` most likely tokens (fewer than top_k tokens are strictly more
  likely) and p(x) >= p(top-1) - delta;
- neither x nor the target's top-1 is a structural token (a reasoning marker, or an end-of-sequence
  id): relaxation never opens or closes a span, starts a tool call or ends the output where the
  target would not, nor holds one off where the target wants it. Where a span ends, a tool call
  starts and the output stops is decided strictly, as the target alone would.
p is the distribution the target samples from: the processed one (temperature, top-k, top-p, min-p)
on sampled rows, softmax of the raw logits on greedy rows, as in TensorRT-LLM.

What it costs: inside reasoning spans the output is no longer distributed as the target's (greedy
output is no longer the target's greedy output); everything outside them is verified strictly.
The statistics count acceptances that only this rule made (`num_relaxed_accepted_tokens`).
No host synchronisation: the mask is computed inside the compiled step for every row, and rows
outside a span simply get False.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.pipelines.reasoning import ReasoningMarkers


@dataclass(frozen=True, slots=True)
class RelaxedAcceptance:
    top_k: int
    delta: float
    markers: ReasoningMarkers
    eos_ids: tuple[int, ...] = ()

    @property
    def structural(self) -> tuple[int, ...]:
        return (*self.markers.all, *self.eos_ids)

    def mask(self, logprobs: torch.Tensor, drafts: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
        """logprobs [B, K+1, V] f32 (as `verify` takes them); drafts [B, K]; inside [B, K] bool
        -> [B, K] bool: drafts the relaxed rule accepts."""
        # logprobs: [B, K+1, V]; drafts: [B, K]; inside: [B, K]
        # softmax: normalised log-probs come back as their probabilities, raw logits at temperature 1
        p = torch.softmax(logprobs[:, :-1], dim=-1)                       # [B, K, V]
        p_x = p.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)              # [B, K]
        more_likely = (p > p_x.unsqueeze(-1)).sum(dim=-1)
        top, top_token = p.max(dim=-1)
        candidate = (more_likely < self.top_k) & (p_x >= top - self.delta) & (p_x > 0)
        return inside & candidate & ~self._is_structural(drafts) & ~self._is_structural(top_token)

    def _is_structural(self, tokens: torch.Tensor) -> torch.Tensor:
        found = torch.zeros_like(tokens, dtype=torch.bool)
        for token in self.structural:
            found |= tokens == token
        return found
