"""Jump-forward proposals: the tokens a response format forces next (specgen/structured), verified as
host drafts.

Where the grammar leaves one way on (a JSON key with its quotes and colon, a fixed literal), plain
decoding would still spend one target step per token. Proposed as drafts, those tokens are verified
in one step, like suffix drafting's (drafts/suffix.py): the verify decides every token, so the output
stays the target's under the constraint, and a forced token the target would split otherwise is
only a rejected draft.

Contract: `ForcedProposer(grammars, inner=None)` is a host proposer (the interface of
`drafts.suffix.SuffixProposer`: reset / new_job / admit / extend / finish / move / propose). `grammars`
is the runner's live dict slot -> grammar state (`structured.grammar.SlotGrammar`, over the request's
committed tokens; only its `forced(k)` is used).
`propose(slot, k)` returns the grammar's forced tokens (at most k), or `inner`'s proposal where
that is expected to yield more (suffix drafting beside it); nothing for a slot without a grammar
or inside a reasoning span. The other calls go to `inner`.
"""

from __future__ import annotations

from specgen.drafts.suffix import NO_PROPOSAL, Proposal

# The chance a forced token is accepted, before the host policy's calibration: the target almost
# always agrees with the grammar's tokenization of the forced text (measured on SmolLM2 under the
# entity schema: forced runs hold 33% of plain decoding's tokens).
FORCED_TOKEN_PROB = 0.9
# The most tokens a jump-forward step verifies when no draft sets K (JSON keys are 2-5 tokens).
JUMP_FORWARD_K = 4


class ForcedProposer:
    def __init__(self, grammars: dict, inner=None) -> None:
        self.grammars = grammars
        self.inner = inner

    def reset(self, job=None) -> None:
        if self.inner is not None:
            self.inner.reset(job)

    def new_job(self):
        return self.inner.new_job() if self.inner is not None else None

    def admit(self, slot: int, prompt_ids) -> None:
        if self.inner is not None:
            self.inner.admit(slot, prompt_ids)

    def extend(self, slot: int, tokens) -> None:
        if self.inner is not None:
            self.inner.extend(slot, tokens)

    def finish(self, slot: int) -> None:
        if self.inner is not None:
            self.inner.finish(slot)

    def move(self, src: int, dst: int) -> None:
        if self.inner is not None:
            self.inner.move(src, dst)

    def propose(self, slot: int, k: int) -> Proposal:
        own = self.inner.propose(slot, k) if self.inner is not None else NO_PROPOSAL
        grammar = self.grammars.get(slot)
        tokens = grammar.forced(k) if grammar is not None and k > 0 else []
        if not tokens:
            return own
        forced = Proposal(tuple(tokens), tuple(FORCED_TOKEN_PROB ** (i + 1) for i in range(len(tokens))))
        return forced if forced.score >= own.score else own
