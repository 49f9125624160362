"""Acceptance statistics as plain data, with vLLM's definitions (vllm/v1/spec_decode/metrics.py).

- a *draft* is one verification of a block of k >= 1 proposed tokens (one step of one request); k may
  change from step to step (`num_speculative_tokens: auto`), up to K = `num_speculative_tokens`;
- `num_draft_tokens` = the sum of k over drafts; `num_accepted_tokens` = drafted tokens the target
  accepted;
- `mean_acceptance_length` = 1 + accepted / drafts: tokens gained per target forward, bonus included
  (over the drafting steps: a plain step is not a draft);
- `draft_acceptance_rate` = accepted / draft tokens;
- `accepted_per_position[i]` = drafts whose token i was accepted; `drafted_per_position[i]` = drafts
  that had a token i (k > i); rate = accepted / drafted there (= accepted / num_drafts for a fixed K);
- `acceptance_histogram[a]` = drafts that accepted exactly a tokens, a = 0..K;
- `k_histogram[k]` = steps of this request that drafted k tokens, k = 0 (plain) .. K;
- `num_relaxed_accepted_tokens` = accepted tokens that only relaxed acceptance accepted (lossy,
  opt-in: pipelines/relaxed.py); they are part of `num_accepted_tokens` and of every figure above.
Counts include tokens later cut by a stop string or max_tokens, as vLLM's do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecCounters:
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_relaxed_accepted_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    k_histogram: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.acceptance_histogram = _padded(self.acceptance_histogram, k + 1)
        self.accepted_per_position = _padded(self.accepted_per_position, k)
        self.drafted_per_position = _padded(self.drafted_per_position, k)
        self.k_histogram = _padded(self.k_histogram, k + 1)

    def record(self, accepted: int, relaxed: int = 0, k: int | None = None) -> None:
        """One step that drafted k tokens (default K; 0 = a plain step) and accepted `accepted` of
        them, `relaxed` of those only through relaxed acceptance."""
        k = self.num_speculative_tokens if k is None else k
        if self.num_speculative_tokens == 0:
            return
        self.k_histogram[k] += 1
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        self.num_relaxed_accepted_tokens += relaxed
        self.acceptance_histogram[accepted] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        for i in range(k):
            self.drafted_per_position[i] += 1

    def merge(self, other: SpecCounters) -> None:
        """Add `other`'s counts (a record written with a smaller K fits in; a larger one widens)."""
        if other.num_speculative_tokens > self.num_speculative_tokens:
            self.num_speculative_tokens = other.num_speculative_tokens
            self.__post_init__()
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_relaxed_accepted_tokens += other.num_relaxed_accepted_tokens
        for mine, theirs in ((self.acceptance_histogram, other.acceptance_histogram),
                             (self.accepted_per_position, other.accepted_per_position),
                             (self.drafted_per_position, other.drafted_per_position),
                             (self.k_histogram, other.k_histogram)):
            for i, n in enumerate(theirs):
                mine[i] += n

    def narrowed(self, k: int) -> SpecCounters:
        """These counts with room for k positions only (0: as wide as needed). Counts past k must be
        zero (a fixed k run on a step that could draft more)."""
        if k <= 0 or k >= self.num_speculative_tokens:
            return self
        assert not any(self.drafted_per_position[k:]) and not any(self.k_histogram[k + 1:]), "drafted past k"
        return SpecCounters(k, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            self.num_relaxed_accepted_tokens, self.acceptance_histogram[: k + 1],
                            self.accepted_per_position[:k], self.drafted_per_position[:k],
                            self.k_histogram[: k + 1])

    @classmethod
    def from_dict(cls, d: dict) -> SpecCounters:
        """The counters of a result record's `spec` (as `to_dict` wrote them). Records from before
        variable k have no `drafted_per_position`: every draft had all K positions."""
        histogram = [int(n) for n in d["acceptance_histogram"]]
        k, drafts = len(histogram) - 1, int(d["num_drafts"])
        drafted = d.get("drafted_per_position")
        return cls(k, drafts, int(d["num_draft_tokens"]),
                   int(d["num_accepted_tokens"]), int(d.get("num_relaxed_accepted_tokens") or 0),
                   histogram, [int(n) for n in d["accepted_per_position"]],
                   [int(n) for n in drafted] if drafted is not None else [drafts] * k,
                   [int(n) for n in d.get("k_histogram") or []])

    @property
    def mean_acceptance_length(self) -> float | None:
        if self.num_drafts == 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafts

    @property
    def draft_acceptance_rate(self) -> float | None:
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    def to_dict(self) -> dict:
        rates = ([a / d if d else None for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
                 if self.num_drafts else None)
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_relaxed_accepted_tokens": self.num_relaxed_accepted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_histogram": list(self.acceptance_histogram),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_rate_per_position": rates,
            "k_histogram": list(self.k_histogram),
        }


def _padded(counts: list[int], n: int) -> list[int]:
    return [*counts, *([0] * (n - len(counts)))] if len(counts) < n else counts
