"""Soft labels: the target's own distribution over the draft vocabulary as the training label.

Contract:
- `teacher_layer(target) -> int`: the layer id whose output the teacher reads (the last one), to be
  captured beside the draft's features in the same forward (and the same feature store);
- `teacher_probs(target, last, draft_to_target) -> [B, T, Vd]`: softmax of the target's logits at
  every position, restricted to the draft vocabulary's rows (the full vocabulary when the map is
  None); row t is the target's distribution of the token at t + 1;
- `label_loss(logits, labels, probs, weight) -> [N]`: per row, `(1 - weight) * CE(logits, label) +
  weight * KL(probs || softmax(logits))`; probs None (or weight 0) is plain hard-label
  cross-entropy. (KL is the references' soft cross-entropy less the target's entropy: the same
  gradient, and a loss that reads 0 where the draft matches.)

Why: a draft is accepted when it agrees with the target, and the target's whole distribution says
more per position than its argmax (which of the runners-up it nearly chose). The EAGLE-3 reference
and SpecForge train on exactly this: softmax of the target head restricted to the draft vocabulary,
scored where the target's top token is inside it (our label mask: a label outside the vocabulary is
never trained on). `train.soft_labels` is the weight; 0 keeps the hard labels of the first sittings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specgen.models.layers import float32_logits


def teacher_layer(target) -> int:
    return target.shape.num_layers - 1


@torch.no_grad()
def teacher_probs(target, last: torch.Tensor, draft_to_target: torch.Tensor | None) -> torch.Tensor:
    # last: [B, T, H], the output of the target's last layer -> [B, T, Vd] float32 probabilities
    head = target.output_embedding
    if draft_to_target is not None:
        head = head[draft_to_target]
    return torch.softmax(float32_logits(target.final_norm(last), head), -1)


def label_loss(logits: torch.Tensor, labels: torch.Tensor, probs: torch.Tensor | None,
               weight: float) -> torch.Tensor:
    # logits: [N, Vd] float32; labels: [N] draft ids; probs: [N, Vd] | None -> per-row loss [N]
    hard = F.cross_entropy(logits, labels, reduction="none")
    if probs is None or weight == 0:
        return hard
    # KL(target || draft): the soft cross-entropy less the target's own entropy, a constant that
    # changes no gradient, so the loss reads 0 where the draft matches and hard labels read the same
    soft = (torch.special.xlogy(probs, probs) - probs * F.log_softmax(logits, -1)).sum(-1)
    return (1 - weight) * hard + weight * soft
