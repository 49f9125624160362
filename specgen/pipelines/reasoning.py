"""Reasoning spans: which tokens of a thinking model's output are its `<think> ... </think>` reasoning.

Contract:
- `ReasoningMarkers.from_vocab(vocab)` finds the markers BY STRING in the tokenizer's vocabulary, never
  by id (DeepSeek renumbers them between versions): `<think>` opens a span; `</think>` closes it, and
  so does the start of a tool-calls section (Kimi `<|tool_calls_section_begin|>`, DeepSeek
  `<｜tool▁calls▁begin｜>`): a model that calls a tool has finished thinking. None when the vocabulary
  has no `<think>` / `</think>` pair (not a reasoning model).
- One rule, on the host (`start_state`, `split`) and on the device (`states_after`): a token is
  reasoning when the last marker before it opened a span. Before the output's first marker, the
  prompt decides. Thinking chat templates end the generation prompt with `<think>`; for example,
  Kimi K2.5 does in thinking mode and writes `<think></think>` in instant mode. So the output starts
  inside a span exactly when the prompt's last marker opened one.
- Implicit start: when neither the prompt nor the output had a marker before an output `</think>`,
  the model reasoned without saying so (DeepSeek-R1 style). `split` counts that text as reasoning.
  The device cannot know it in advance and verifies it as content, i.e. strictly, so it stays
  lossless. A tool-calls start with no marker before it implies nothing: non-thinking models call
  tools too.
- `split` drops `<think>` and `</think>` from both parts (vLLM's parsers do the same). A tool-calls
  start stays in the content, which it begins.
- Only the template's generation prompt sets the start state (the runner passes the prompt from
  `Request.generation_start`): a `<think>` a user typed in a message is text, not the model's span.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALLS_START = ("<|tool_calls_section_begin|>", "<｜tool▁calls▁begin｜>")


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    think_start: int
    think_end: int
    tool_calls_start: tuple[int, ...] = ()

    @classmethod
    def from_vocab(cls, vocab: Mapping[str, int]) -> ReasoningMarkers | None:
        start, end = vocab.get(THINK_START), vocab.get(THINK_END)
        if start is None or end is None:
            return None
        tools = tuple(vocab[s] for s in TOOL_CALLS_START if s in vocab)
        return cls(int(start), int(end), tuple(int(t) for t in tools))

    @property
    def closes(self) -> tuple[int, ...]:
        return (self.think_end, *self.tool_calls_start)

    @property
    def all(self) -> tuple[int, ...]:
        return (self.think_start, *self.closes)


def start_state(prompt_ids: Sequence[int], markers: ReasoningMarkers) -> bool | None:
    """The state the output starts in: True when the prompt's last marker opened a span, False when
    it closed one, None when the prompt holds no marker (see the implicit start above)."""
    closes = set(markers.closes)
    for token in reversed(prompt_ids):
        if token == markers.think_start:
            return True
        if token in closes:
            return False
    return None


class Split(NamedTuple):
    reasoning: list[int]
    content: list[int]
    ends_in_reasoning: bool        # the output's last token is reasoning (where a stop string lies)


def split(token_ids: Sequence[int], markers: ReasoningMarkers, start: bool | None) -> Split:
    """Output ids -> reasoning ids and content ids, markers placed as the module docstring says."""
    reasoning: list[int] = []
    content: list[int] = []
    undecided: list[int] = []      # tokens before any marker when the prompt had none
    state = start
    for token in token_ids:
        if token == markers.think_start:
            content += undecided   # an explicit opening: what came before was content
            undecided, state = [], True
        elif token in markers.closes:
            if state is None:      # only `</think>` says a span was open all along
                (reasoning if token == markers.think_end else content).extend(undecided)
                undecided = []
            state = False
            if token != markers.think_end:
                content.append(token)
        elif state is None:
            undecided.append(token)
        else:
            (reasoning if state else content).append(token)
    return Split(reasoning, content + undecided, bool(state) and bool(token_ids))


def states_after(tokens: torch.Tensor, before: torch.Tensor, markers: ReasoningMarkers) -> torch.Tensor:
    """The same rule on the device, for a block of tokens per row, without host synchronisation.

    tokens [B, T] int64; before [B] bool (the state before tokens[:, 0]; an unknown state is False)
    -> [B, T] bool: whether each token leaves its row inside a span (the state of the token after it).
    """
    # tokens: [B, T]; before: [B]
    opens = tokens == markers.think_start
    marks = opens.clone()
    for token in markers.closes:
        marks |= tokens == token
    T = tokens.shape[1]
    index = torch.arange(T, device=tokens.device)
    # the last marker at or before each token: a masked max over a [T, T] lower triangle (T = K + 1
    # is small; a cummax would do the same in one pass but is a fallback op for the compiler)
    visible = marks[:, None, :] & (index[None, :, None] >= index[None, None, :])       # [B, T, T]
    last = torch.where(visible, index, -1).amax(dim=-1)                                # [B, T]
    opened = opens.gather(1, last.clamp(min=0))
    return torch.where(last >= 0, opened, before[:, None])

