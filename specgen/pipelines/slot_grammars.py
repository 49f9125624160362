"""Structured output in the batch: each structured slot's grammar state and the token masks of its rows.

Contract: `SlotGrammars(engine, state, jump_forward)` keeps `states` (slot -> SlotGrammar, the
response format's state over the committed tokens) and the host copy of every slot's row masks
(`host_masks`, [B, K+1, W] int32, -1 = all allowed). Every host row is copied to the device in one
transfer per step, so a slot that holds no grammar must have all-allowed rows on the host: set at
admission (`start`), reset when a slot is freed (`free`) and moved with its slot (`move`).
- `start(admitted, starts)`: each admitted request's state (those with a response_format) and the
  row-0 mask its first token is sampled under (the prefill's); returns the states and {slot: error}
  for formats that do not compile. `take(slot, grammar, first)` admits the state once the prefill's
  first token is known (a refusal is the request's error).
- `write(k, totals)`: before the verify of a step of k drafts, each structured slot's k + 1 row
  masks: row i allows what its grammar allows after the committed tokens and the drafts before it
  (read from `pending`); a draft the grammar refuses gives way to the tokens it forces (jump-forward,
  structured/grammar.py) where drafts are argmax choices.
`states` is shared with the host proposer of forced tokens (drafts/forced.py).
"""

from __future__ import annotations

import time

import torch

from specgen.structured.grammar import GrammarEngine, GrammarError, SlotGrammar


class SlotGrammars:
    def __init__(self, engine: GrammarEngine, state, jump_forward: bool) -> None:
        self.engine = engine
        self.state = state                    # the step's StepState (pending, token_masks, draft_probs)
        self.jump_forward = jump_forward
        self.states: dict[int, SlotGrammar] = {}
        self.host_masks = torch.full(tuple(state.token_masks.shape), -1, dtype=torch.int32)

    def reset(self) -> None:
        """No slot structured (a new run; an interrupted one may have left some)."""
        self.states.clear()
        self.host_masks.fill_(-1)
        self.state.token_masks.fill_(-1)

    def start(self, admitted, starts: dict[int, bool | None], closes: tuple = ()
              ) -> tuple[dict[int, SlotGrammar], dict[int, str]]:
        """`admitted`: (slot, request) pairs; `starts`: each slot's reasoning start state; `closes`:
        the tokens that close a reasoning span (the format applies after them)."""
        grammars, bad = {}, {}
        for b, request in admitted:
            self.host_masks[b].fill_(-1)
            if request.response_format is None:
                continue
            try:
                grammar = self.engine.matcher(request.response_format, closes, thinking=starts[b] is True)
            except GrammarError as err:
                bad[b] = str(err)
                continue
            grammar.fill(self.host_masks[b, :1], [])
            grammars[b] = grammar
        for b, _ in admitted:
            self.state.token_masks[b].copy_(self.host_masks[b])
        return grammars, bad

    def take(self, b: int, grammar: SlotGrammar, first: int) -> str | None:
        """Slot b's state from now on, after the prefill's first token `first` (it reaches the host
        with the slot's first step, but that step's rows are masked after it). Returns an error
        where the grammar refuses it."""
        self.states[b] = grammar
        if not grammar.advance(first):
            return f"structured output: the grammar refused the first token {first} (a specgen bug)"
        return None

    def write(self, k: int, totals) -> None:
        if not self.states:
            return
        start = time.perf_counter()
        pending = self.state.pending
        drafts = pending[:, 1:k + 1].tolist() if k else None
        host = self.host_masks
        # forced tokens replace refused drafts only where the drafts are argmax choices: a stochastic
        # draft's token must be the one its stored distribution q sampled
        jump = self.jump_forward and self.state.draft_probs is None
        for b, grammar in self.states.items():
            walk = grammar.fill(host[b, :k + 1], drafts[b] if k else [], jump_forward=jump)
            if walk.written:
                pending[b, 1:k + 1].copy_(torch.tensor(walk.drafts))
            totals.grammar_drafts += walk.written
            totals.refused_drafts += walk.refused
        self.state.token_masks[:, :k + 1].copy_(host[:, :k + 1], non_blocking=True)
        totals.mask_seconds += time.perf_counter() - start

    def free(self, b: int) -> None:
        """Slot b holds no grammar: its rows allow everything, on the host and on the device."""
        self.states.pop(b, None)
        self.host_masks[b].fill_(-1)
        self.state.token_masks[b].fill_(-1)

    def move(self, src: int, dst: int) -> None:
        """Slot src's state and host rows to dst (the device's rows move with the slot's tensors).
        Every moved slot's rows move, structured or not: `dst` may hold the rows of a finished
        structured request (issue 68)."""
        if src in self.states:
            self.states[dst] = self.states.pop(src)
        self.host_masks[dst] = self.host_masks[src]
        self.free(src)
