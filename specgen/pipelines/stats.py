"""Acceptance statistics as plain data, with vLLM's definitions (vllm/v1/spec_decode/metrics.py).

- a *draft* is one verification of a block of K proposed tokens (one step of one request);
- `num_draft_tokens` = K x num_drafts; `num_accepted_tokens` = drafted tokens the target accepted;
- `mean_acceptance_length` = 1 + accepted / drafts: tokens gained per target forward, bonus included;
- `draft_acceptance_rate` = accepted / draft tokens;
- `accepted_per_position[i]` = drafts whose token i was accepted (rate = that / num_drafts);
- `acceptance_histogram[a]` = drafts that accepted exactly a tokens, a = 0..K;
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

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.acceptance_histogram = self.acceptance_histogram or [0] * (k + 1)
        self.accepted_per_position = self.accepted_per_position or [0] * k

    def record(self, accepted: int, relaxed: int = 0) -> None:
        """One verified block that accepted `accepted` of its K drafts, `relaxed` of them only through
        relaxed acceptance."""
        if self.num_speculative_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += self.num_speculative_tokens
        self.num_accepted_tokens += accepted
        self.num_relaxed_accepted_tokens += relaxed
        self.acceptance_histogram[accepted] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecCounters) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_relaxed_accepted_tokens += other.num_relaxed_accepted_tokens
        for i, n in enumerate(other.acceptance_histogram):
            self.acceptance_histogram[i] += n
        for i, n in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += n

    @classmethod
    def from_dict(cls, d: dict) -> SpecCounters:
        """The counters of a result record's `spec` (as `to_dict` wrote them)."""
        histogram = [int(n) for n in d["acceptance_histogram"]]
        return cls(len(histogram) - 1, int(d["num_drafts"]), int(d["num_draft_tokens"]),
                   int(d["num_accepted_tokens"]), int(d.get("num_relaxed_accepted_tokens") or 0),
                   histogram, [int(n) for n in d["accepted_per_position"]])

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
        rates = [n / self.num_drafts for n in self.accepted_per_position] if self.num_drafts else None
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
            "acceptance_rate_per_position": rates,
        }
