"""A draft's reduced vocabulary: its head scores Vd of the target's V tokens.

Contract. The layout is EAGLE-3's (vLLM, SGLang and SpecForge read it): the config states
`draft_vocab_size` (< `vocab_size`), the checkpoint holds `d2t [Vd]` as OFFSETS (target id =
draft id + d2t[draft id]) and `t2d [V]` (bool, in the draft vocabulary; derivable, so never read).
- `read_draft_vocab_size(config, vocab)`: the config's size (absent = the full vocabulary).
- `draft_to_target(d2t, draft_vocab, vocab, where)`: the offsets -> the draft->target id map [Vd],
  checked to land inside the target vocabulary (CheckpointError naming `where` otherwise).
- `d2t_tensors(mapping, vocab)`: the map -> the `d2t` / `t2d` tensors a checkpoint stores.
- `to_target_logits(logits [..., Vd], mapping, vocab) -> [..., V]`: a token outside the draft
  vocabulary gets -inf, so it is never drafted and a stochastic draft gives it probability 0 (the
  rejection sampler stays exact: the target's residual still covers it).
- `label_map(mapping, vocab) -> [V]`: target id -> draft id, -1 outside (training skips those labels).

EAGLE-3 trains a head of its own over the draft vocabulary. DFlash and MTP score with the target's
head (or MTP's own full one), so their reduced head is that head's `mapping` rows, gathered at load
(`HeadRows`, which both mix in):
the checkpoint adds only `d2t` / `t2d` and `draft_vocab_size`, and a loader that does not know the
extension ignores them and scores the full vocabulary with the same weights (a slower pass over all
V rows, whose argmax may fall outside the Vd).
"""

from __future__ import annotations

import torch

from specgen.errors import CheckpointError


def read_draft_vocab_size(config: dict, vocab_size: int) -> int:
    size = int(config.get("draft_vocab_size") or vocab_size)
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size {size} must be in 1..vocab_size {vocab_size}")
    return size


def check_d2t_shape(d2t, draft_vocab_size: int, where: str) -> None:
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise CheckpointError(f"{where}: d2t has shape {list(d2t.shape)}, expected [{draft_vocab_size}]")


def draft_to_target(d2t: torch.Tensor, draft_vocab_size: int, vocab_size: int, where: str) -> torch.Tensor:
    """The checkpoint's `d2t` offsets -> the draft->target id map [Vd], inside the target vocabulary."""
    check_d2t_shape(d2t, draft_vocab_size, where)
    mapping = torch.arange(draft_vocab_size, device=d2t.device) + d2t.long()
    low, high = int(mapping.min()), int(mapping.max())
    if low < 0 or high >= vocab_size:
        raise CheckpointError(f"{where}: d2t maps draft ids to {low}..{high}, outside the target vocabulary "
                              f"0..{vocab_size - 1}")
    return mapping


def d2t_tensors(mapping: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    mapping = mapping.cpu()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[mapping] = True
    return {"d2t": mapping - torch.arange(mapping.numel()), "t2d": t2d}


def to_target_logits(logits: torch.Tensor, mapping: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # logits: [..., Vd] over the draft vocabulary -> [..., V], -inf outside it
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy(-1, mapping, logits)


def label_map(mapping: torch.Tensor, vocab_size: int) -> torch.Tensor:
    # mapping: [Vd] -> [V] int64: the draft id of each target id, -1 outside the draft vocabulary
    out = torch.full((vocab_size,), -1, dtype=torch.long, device=mapping.device)
    out[mapping] = torch.arange(mapping.numel(), device=mapping.device)
    return out


def most_frequent(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent ids of `token_counts` [V], in id order (ties broken by id)."""
    return torch.sort(torch.argsort(-token_counts.double(), stable=True)[:size]).values


def take_d2t(state: dict, draft_vocab_size: int, vocab_size: int, where: str) -> torch.Tensor | None:
    """Remove `d2t` / `t2d` from a checkpoint's tensors (in place); returns the draft->target map
    when the vocabulary is reduced (None for a full one, and for a dry load, whose tensors are
    headers: it checks the shape only; inspect-checkpoint reads d2t for the range)."""
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)
    if draft_vocab_size == vocab_size:
        return None
    if d2t is None:
        raise CheckpointError(f"{where}: draft_vocab_size {draft_vocab_size} < vocab_size {vocab_size} "
                              "but the checkpoint has no d2t")
    check_d2t_shape(d2t, draft_vocab_size, where)
    if not isinstance(d2t, torch.Tensor):
        return None
    return draft_to_target(d2t, draft_vocab_size, vocab_size, where)


class HeadRows:
    """For drafts that score with a full head (DFlash: the target's; MTP: the shared or its own): a
    reduced vocabulary is that head's `d2t` rows, gathered once. A draft mixing this in provides
    `config.vocab_size`, `config.draft_vocab_size` and `full_head() -> ([V, H] weight, run dtype)`,
    and calls `_register_head_rows()` in `__init__` and `_init_head_rows(device)` in `init_buffers`."""

    def _register_head_rows(self) -> None:
        # draft id -> target id [Vd], and the head's rows for it [Vd, H] (None for the full vocabulary)
        self.register_buffer("draft_to_target", None, persistent=False)
        self.register_buffer("head_rows", None, persistent=False)

    @property
    def reduced_vocab(self) -> bool:
        return self.config.draft_vocab_size != self.config.vocab_size

    def _init_head_rows(self, device) -> None:
        if self.reduced_vocab:          # the first Vd ids until the checkpoint's d2t says which
            self.select_vocabulary(torch.arange(self.config.draft_vocab_size, device=device))

    def select_vocabulary(self, mapping: torch.Tensor) -> None:
        # mapping: [Vd] target ids -> the rows of the full head that the draft scores (a copy)
        head, dtype = self.full_head()
        head = head.detach()
        self.draft_to_target = mapping.to(head.device)
        self.head_rows = head[self.draft_to_target].to(dtype)

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        # [..., Vd] -> [..., V] (-inf outside the draft vocabulary; unchanged for the full one)
        if not self.reduced_vocab:
            return logits
        return to_target_logits(logits, self.draft_to_target, self.config.vocab_size)
