"""When a request is finished: EOS ids, stop strings, max_tokens, and the sequence-length limit.

Contract: tokens of an accepted block are fed ONE AT A TIME through `OutputTracker.add`, which says
after each whether the request is finished, so the first stop inside a block wins and `max_tokens` is
applied after it (a stop string completed by the block's 2nd token ends the request there, even when
max_tokens would have allowed the whole block). Stop strings are cut from the text, as vLLM does; an
EOS id stays in `token_ids` and out of the text.

Stop strings are searched in text decoded INCREMENTALLY (vLLM's scheme): each new token decodes a
short window that starts a few tokens back, and the text it adds is what that window gained over
the same window without it. Per token this costs a few tokens of decoding, not the whole output.
Where the window's text holds a replacement character (a character split over tokens, or bytes
that are no text), the whole output is decoded instead, so the searched text is always exactly the
full decode of the tokens so far.
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
    _decoded: str = ""                   # text of token_ids[:_read] (stop strings only)
    _prefix: int = 0                     # start of the decode window
    _read: int = 0                       # tokens whose text is in _decoded
    _whole_decode: bool = False          # the text so far ends inside a character

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
        old = self._decoded
        self._decode_new_tokens()
        new = self._decoded
        if new == old:
            return False
        # Only text from the first change on can hold a new match (less the longest stop string).
        changed = len(old) if new.startswith(old) else next(
            i for i, (a, b) in enumerate(zip(old, new + "\0")) if a != b)
        start = max(0, changed - max(len(s) for s in self.rules.stop_strings) + 1)
        hits = [i for i in (new.find(s, start) for s in self.rules.stop_strings) if i >= 0]
        if hits:
            self.text = new[: min(hits)]
            return True
        return False

    def _decode_new_tokens(self) -> None:
        decode, ids = self.rules.decode, self.token_ids
        if not self._whole_decode:
            before = decode(ids[self._prefix: self._read])
            after = decode(ids[self._prefix:])
            if "\ufffd" not in after:
                if len(after) > len(before):
                    self._decoded += after[len(before):]
                    self._prefix, self._read = self._read, len(ids)
                return
        # A character split over tokens, or bytes that are no text: a window's text cannot be
        # trusted, so decode everything (rare on real text) until the text ends whole, and restart
        # the window there.
        self._decoded = decode(ids)
        self._whole_decode = self._decoded.endswith("\ufffd")
        if not self._whole_decode:
            self._prefix = self._read = len(ids)

    def final_text(self) -> str:
        return self.text if self.text is not None else self.rules.decode(self.token_ids)


def cut_at_stop(text: str, stop_strings: tuple[str, ...], start: int = 0) -> str:
    """`text` up to its first stop string found from `start` on (whole when there is none)."""
    hits = [i for i in (text.find(s, max(0, start)) for s in stop_strings) if i >= 0]
    return text[: min(hits)] if hits else text


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
