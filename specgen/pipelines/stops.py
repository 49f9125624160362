"""When a request is finished: EOS ids, stop strings, max_tokens, and the sequence-length limit.

Contract: tokens of an accepted block are fed ONE AT A TIME through `OutputTracker.add`, which says
after each whether the request is finished, so the first stop inside a block wins and `max_tokens` is
applied after it (a stop string completed by the block's 2nd token ends the request there, even when
max_tokens would have allowed the whole block). Stop strings are cut from the text, as vLLM does; an
EOS id stays in `token_ids` and out of the text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class StopRules:
    eos_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    ignore_eos: bool
    decode: Callable[[list[int]], str]


@dataclass(slots=True)
class OutputTracker:
    rules: StopRules
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None              # set when a stop string cut it
    finish_reason: str | None = None
    _checked_chars: int = 0

    def add(self, token: int) -> bool:
        """Append one token; True when the request is finished (then `finish_reason` is set)."""
        self.token_ids.append(token)
        if token in self.rules.eos_ids and not self.rules.ignore_eos:
            self.finish_reason = "stop"
        elif self.rules.stop_strings and self._find_stop_string():
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _find_stop_string(self) -> bool:
        text = self.rules.decode(self.token_ids)
        # Only the tail can hold a new match: earlier text was searched after earlier tokens.
        start = max(0, self._checked_chars - max(len(s) for s in self.rules.stop_strings) + 1)
        hits = [i for i in (text.find(s, start) for s in self.rules.stop_strings) if i >= 0]
        self._checked_chars = len(text)
        if hits:
            self.text = text[: min(hits)]
            return True
        return False

    def final_text(self) -> str:
        return self.text if self.text is not None else self.rules.decode(self.token_ids)


def eos_ids_from(tokenizer, generation_config: dict | None, config: dict) -> frozenset[int]:
    """EOS ids from the tokenizer, the generation config and the model config, merged."""
    ids: set[int] = set()
    for source in (generation_config or {}, config):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, Sequence):
            ids.update(int(v) for v in value)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    return frozenset(ids)
