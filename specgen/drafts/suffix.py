"""Suffix drafting: proposals from text already seen, made on the host, for any target (no checkpoint).

Contract. `SuffixProposer` keeps, per live slot, an index over its prompt and the tokens committed so
far, and one job-wide index over the outputs of the requests this job has finished (the job's
requests resemble each other: later answers reuse earlier ones). Before a step the runner asks
`propose(slot, k)` for at most k tokens; the runner writes them into the step's `pending` row (a
`[B, k]` block: the unified step never knows where its drafts came from) and, after the step, feeds
the committed tokens back with `extend(slot, tokens)`. `finish(slot)` moves a finished request's
output into the job-wide index. The job-wide index never outlives the job; it starts from earlier
answers only where the recipe asks (`draft.suffix_history`: a results file).

How a proposal is made (SuffixDecoding, Oliaro et al., NeurIPS 2025, as ArcticInference and vLLM run
it; their defaults): take the longest suffix of the slot's context (at most `max_depth` tokens, at
least 2) that occurred before in an index; among its occurrences, follow the most frequent next
token, then the most frequent one after that among the occurrences that agree so far, while the
estimated probability of the whole path (the product of the frequencies) stays >= `min_token_prob`,
and for at most `max_spec_factor` x the matched length tokens. The proposal's `score` is the sum of
the path's probabilities: the tokens the target is expected to accept. Of the slot's own index and
the job's, the proposal with the higher score wins.

Why an index of positions rather than a suffix tree: a depth-24 suffix trie keeps up to 24 nodes per
token (a Python dict node costs ~200 bytes: kilobytes per token); `SuffixIndex` keeps the tokens
and, for every pair of consecutive tokens, where it occurred (at most about 80 bytes per token:
77 on a stream where few pairs repeat, tests/test_suffix.py), and answers the same question (which continuations follow the longest
matched suffix, how often) by comparing tokens backwards from each occurrence of the last pair.
Only the most recent `max_candidates` occurrences of a pair are compared: a very frequent pair
("\\n\\n" in a long job) costs no more than a rare one, at the price of forgetting old occurrences.
"""

from __future__ import annotations

import sys
from array import array
from dataclasses import dataclass

# SuffixDecoding's defaults (vLLM's suffix_decoding_max_tree_depth / _max_spec_factor / _min_token_prob)
MAX_DEPTH = 24
MAX_SPEC_FACTOR = 1.0
MIN_TOKEN_PROB = 0.1
MAX_CANDIDATES = 256
# The job-wide index keeps the newest outputs up to this many tokens (at most about 80 MB;
# test_suffix.py measures the bytes per token), dropping the oldest whole outputs first.
JOB_INDEX_TOKENS = 1_000_000

_END = -1           # closes a sequence in an index: no continuation crosses it
_PAIR_SHIFT = 32    # a pair's key: first << 32 | second (token ids are below 2^31)


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()    # the estimated probability that the path up to each token is accepted

    @property
    def score(self) -> float:
        """The tokens the target is expected to accept from this proposal."""
        return sum(self.probs)

    def __len__(self) -> int:
        return len(self.tokens)


NO_PROPOSAL = Proposal()


def _pair(first: int, second: int) -> int:
    return (first << _PAIR_SHIFT) | second


class SuffixIndex:
    """Token sequences, appended one after another, and where each pair of consecutive tokens ends.

    `append(tokens)` extends the open sequence; `close()` ends it (the next `append` starts another).
    `propose(context, k)` continues `context` (its last tokens are the pattern) from what the index
    holds. `max_tokens` (None: no cap) keeps the newest closed sequences within that many tokens."""

    def __init__(self, *, max_depth: int = MAX_DEPTH, max_spec_factor: float = MAX_SPEC_FACTOR,
                 min_token_prob: float = MIN_TOKEN_PROB, max_candidates: int = MAX_CANDIDATES,
                 max_tokens: int | None = None) -> None:
        if max_depth < 2:
            raise ValueError("max_depth must be >= 2")
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.max_candidates = max_candidates
        self.max_tokens = max_tokens
        self._clear()

    def _clear(self) -> None:
        self.tokens = array("i")
        # where each pair of consecutive tokens occurred, newest first: `last[pair]` is the position
        # of its newest second token, `earlier[i]` the one before position i's pair (-1: none)
        self.last: dict[int, int] = {}
        self.earlier = array("i")
        self.sequences = 0                      # closed sequences held

    def __len__(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        """Memory held: the tokens, the pair table, its keys and position arrays."""
        return (sys.getsizeof(self.tokens) + sys.getsizeof(self.earlier) + sys.getsizeof(self.last)
                + sum(sys.getsizeof(key) + sys.getsizeof(i) for key, i in self.last.items()))

    def append(self, tokens) -> None:
        seq, last, earlier = self.tokens, self.last, self.earlier
        previous = seq[-1] if seq else _END
        for token in tokens:
            token = int(token)
            if token < 0:
                raise ValueError(f"token ids are >= 0, got {token}")
            if previous == _END:
                earlier.append(-1)
            else:
                key = _pair(previous, token)
                earlier.append(last.get(key, -1))
                last[key] = len(seq)
            seq.append(token)
            previous = token

    def close(self) -> None:
        """End the open sequence (nothing continues across the boundary); apply the cap."""
        if self.tokens and self.tokens[-1] != _END:
            self.tokens.append(_END)
            self.earlier.append(-1)
            self.sequences += 1
            if self.max_tokens is not None and len(self.tokens) > self.max_tokens:
                self._keep_newest(self.max_tokens * 3 // 4)

    def _keep_newest(self, budget: int) -> None:
        # rebuilt from the newest closed sequences that fit in `budget` tokens: every cap-th / 4
        # tokens, one pass over at most `budget` of them (amortised: a few appends per token)
        seq = self.tokens
        cut = len(seq) - budget
        start = seq.index(_END, max(cut - 1, 0)) + 1 if cut > 0 else 0
        kept = seq[start:]
        self._clear()
        sequence: list[int] = []
        for token in kept:
            if token == _END:
                self.append(sequence)
                self.close()
                sequence = []
            else:
                sequence.append(token)

    def propose(self, context, k: int, *, live: bool = False) -> Proposal:
        """At most k tokens to follow `context` (a sequence of ids; only its last `max_depth`
        matter). `live`: `context` is this index's own open sequence, whose end (the pattern itself)
        is not an occurrence."""
        pattern = list(context[-self.max_depth:])
        if k <= 0 or len(pattern) < 2:
            return NO_PROPOSAL
        seq, earlier, n = self.tokens, self.earlier, len(self.tokens)
        i = self.last.get(_pair(pattern[-2], pattern[-1]), -1)
        if live and i == n - 1:
            i = earlier[i]                     # the pattern's own end is no occurrence
        depth = len(pattern)
        best, occurrences = 0, []
        for _ in range(self.max_candidates):
            if i < 0:
                break
            # the matched length, comparing backwards from the pair (a closed sequence's _END stops it)
            m = 2
            while m < depth and i - m >= 0 and seq[i - m] == pattern[-1 - m]:
                m += 1
            if m > best:
                best, occurrences = m, [i]
            elif m == best:
                occurrences.append(i)
            i = earlier[i]
        if not occurrences:
            return NO_PROPOSAL
        limit = min(k, int(self.max_spec_factor * best))
        tokens: list[int] = []
        probs: list[float] = []
        prob = 1.0
        for step in range(1, limit + 1):
            counts: dict[int, int] = {}
            for i in occurrences:
                if i + step < n:
                    token = seq[i + step]
                    if token != _END:
                        counts[token] = counts.get(token, 0) + 1
            if not counts:
                break
            # the most frequent continuation; ties to the smallest id (deterministic)
            token = min(counts, key=lambda t: (-counts[t], t))
            p = prob * counts[token] / len(occurrences)
            if p < self.min_token_prob:
                break
            tokens.append(token)
            probs.append(p)
            prob = p
            occurrences = [i for i in occurrences if i + step < n and seq[i + step] == token]
        return Proposal(tuple(tokens), tuple(probs))


class SuffixProposer:
    """Per-slot indices over prompt and output, one job-wide index over finished outputs. `history`:
    earlier answers (token ids, oldest first) the job-wide index starts from at every run, asked for
    with `draft.suffix_history`; without it nothing crosses runs."""

    def __init__(self, slots: int, *, job_tokens: int = JOB_INDEX_TOKENS, history=(), **settings) -> None:
        self.slots, self.job_tokens, self.settings = slots, job_tokens, settings
        newest: list[list[int]] = []
        kept = 0
        for answer in reversed(list(history)):     # the newest answers that fit under the cap
            kept += len(answer) + 1
            if kept > job_tokens:
                break
            newest.append(list(answer))
        self.history = newest[::-1]
        self.reset()

    def reset(self, job: SuffixIndex | None = None) -> None:
        """Forget the run: no slot live, the job-wide index holding the history alone (a new run);
        `job`: carry on with that job-wide index instead (`new_job()`'s: one job run in parts, as
        bench runs a round in legs), which this run then extends."""
        self.requests: list[SuffixIndex | None] = [None] * self.slots
        self.outputs: list[list[int]] = [[] for _ in range(self.slots)]
        self.job = job if job is not None else self.new_job()

    def new_job(self) -> SuffixIndex:
        """A job-wide index holding the history alone."""
        job = SuffixIndex(max_tokens=self.job_tokens, **self.settings)
        for answer in self.history:
            job.append(answer)
            job.close()
        return job

    def admit(self, slot: int, prompt_ids) -> None:
        index = self.requests[slot] = SuffixIndex(**self.settings)
        index.append(prompt_ids)
        self.outputs[slot] = []

    def extend(self, slot: int, tokens) -> None:
        index = self.requests[slot]
        if index is not None:
            index.append(tokens)
            self.outputs[slot].extend(tokens)

    def finish(self, slot: int) -> None:
        """The slot's request ended: its output joins the job-wide index."""
        if self.requests[slot] is not None and self.outputs[slot]:
            self.job.append(self.outputs[slot])
            self.job.close()
        self.requests[slot] = None
        self.outputs[slot] = []

    def move(self, src: int, dst: int) -> None:
        self.requests[dst], self.requests[src] = self.requests[src], None
        self.outputs[dst], self.outputs[src] = self.outputs[src], []

    def propose(self, slot: int, k: int) -> Proposal:
        index = self.requests[slot]
        # no output token yet: the prefill sampled the first one on the device, and the host learns
        # it with the slot's first step; a proposal from the prompt's end would be one position early
        if index is None or k <= 0 or not self.outputs[slot]:
            return NO_PROPOSAL
        context = index.tokens[-index.max_depth:]
        own = index.propose(context, k, live=True)
        job = self.job.propose(context, k) if len(self.job) else NO_PROPOSAL
        return job if job.score > own.score else own
