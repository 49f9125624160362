"""Chained drafting, shared by EAGLE-3 and MTP: one pass over the new entries, then K - 1 single steps.

Contract. A chained draft provides:
- `first_feature(aux) -> feature [B, T, H]`: the first pass's feature from the captured target
  hidden states (EAGLE-3: `fc` over low|mid|high; MTP: the target's final norm);
- `pass_with(feature [B, T, H], tokens [B, T], positions [B, T], attention) -> hidden [B, T, H]`:
  entry j pairs the feature of position p_j with the token at p_j + 1 and returns the layer's
  pre-norm output (which predicts the token at p_j + 2); `attention` binds where keys live
  (models/layers.py `Attention`), and `_pass(feature, tokens, cache, attn)` is `pass_with` bound to
  the draft's KV cache, whose entry for p_j sits at p_j;
- `draft_logits(hidden [..., H]) -> [..., Vd]` over its own vocabulary, and `_logits(hidden [B, H])
  -> [B, V]` over the TARGET vocabulary.
Draft training (training/unroll.py) runs the same `pass_with` with its own key memory.

`chain_propose` runs the first pass over all T new entries and reads row `last_index` (the last
committed position), then k - 1 single-token passes, each feeding back the previous pre-norm output as
the feature and the drafted token as the token. k = 0 runs the first pass alone: the draft absorbs
the entries into its cache and proposes nothing (a prefill, or a catch-up after plain steps). Draft-cache entries sit at absolute positions, aligned
with the target's, so rejected entries are scratch past the committed length (DESIGN.md section 3).
"""

from __future__ import annotations

import torch

from specgen.drafts.base import Pick
from specgen.models.attention import AttentionBatch


def chain_propose(draft, feature: torch.Tensor, next_tokens: torch.Tensor, last_index: torch.Tensor,
                  cache, attn: AttentionBatch, pick: Pick, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    # feature: [B, T, H]; next_tokens (token at p + 1): [B, T]; last_index: [B]; attn.positions (p): [B, T]
    # returns tokens [B, k] and their probabilities [B, k, V] (None for argmax drafts)
    batch = feature.shape[0]
    hidden = draft._pass(feature, next_tokens, cache, attn)
    if k == 0:
        return next_tokens[:, :0], None
    rows = torch.arange(batch, device=feature.device)
    hidden = hidden[rows, last_index].unsqueeze(1)           # [B, 1, H]
    position = attn.positions[rows, last_index] + 1           # feature position of the next pass
    tokens, probs = [], []
    for i in range(k):
        token, prob = pick(draft._logits(hidden[:, 0]), position + 1)  # the drafted token sits at p + 1
        tokens.append(token)
        probs.append(prob)
        if i + 1 < k:
            hidden = draft._pass(hidden, token.unsqueeze(1), cache, attn.at(position.unsqueeze(1)))
            position = position + 1
    stacked = torch.stack(probs, 1) if probs[0] is not None else None
    return torch.stack(tokens, 1), stacked
