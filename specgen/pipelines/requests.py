"""What goes into the runner and what comes out: requests, completions, progress and a run's totals.

Contract: a `Request` is one prompt's ids with its limits, noise key and constraint (an `error` set
before generation makes it an error record); a `Completion` is its result, exactly one per request;
`Progress` is what a progress bar shows; `RunTotals` are a run's counters (live: readable after an
interrupt). `Slot` is a request while it holds a slot of the batch, and `completion_of(slot, ...)`
turns it into its Completion: the text as decoded, or split into reasoning and content where the
run has reasoning markers, a stop string cut from the part that took the last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specgen.pipelines.reasoning import ReasoningMarkers, split
from specgen.pipelines.stats import SpecCounters
from specgen.pipelines.stops import OutputTracker, StopRules, cut_at_stop
from specgen.structured.formats import ResponseFormat
from specgen.structured.grammar import SlotGrammar


@dataclass(slots=True)
class Request:
    id: str
    prompt_ids: list[int]
    max_tokens: int
    request_key: int                 # position-keyed noise depends on (seed, request_key, position)
    error: str | None = None         # a request that failed before generation (bad line, tokenizer)
    generation_start: int = 0        # where the chat template's generation prompt starts in prompt_ids
    response_format: ResponseFormat | None = None   # the output's constraint (specgen/structured)


@dataclass(slots=True)
class Completion:
    id: str
    token_ids: list[int]
    text: str
    finish_reason: str               # stop | length | error
    num_prompt_tokens: int
    spec: SpecCounters | None
    error: str | None = None
    reasoning_text: str | None = None    # the reasoning, split from `text` (None: there was none)
    num_reasoning_tokens: int = 0
    logprobs: list[dict] | None = None   # one entry per token of token_ids (pipelines/logprobs.py)
    prompt_logprobs: list[dict | None] | None = None   # one per prompt token (the first: None)


@dataclass(slots=True)
class Progress:
    finished: int
    output_tokens: int
    elapsed: float
    totals: SpecCounters

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.elapsed if self.elapsed > 0 else 0.0


@dataclass(slots=True)
class Slot:
    request: Request
    tracker: OutputTracker
    counters: SpecCounters
    first_step: int                  # the first step whose results belong to this request
    reasoning_start: bool | None = None   # the state the prompt leaves the output in
    logprobs: list[dict] | None = None    # one entry per token added to the tracker (logprobs on)
    prompt_logprobs: list[dict | None] | None = None
    grammar: SlotGrammar | None = None    # the response format's state over the committed tokens
    error: str | None = None

    def take(self, token: int, in_grammar: bool = False) -> bool:
        """Add a committed token to the request's output (and, unless `in_grammar`, its grammar); True
        when it ends it: a stop (EOS, a stop string), its length, or its grammar's end."""
        grammar = self.grammar
        # a token the grammar refuses (never one the masks allowed; the first token was taken at
        # admission, where a refusal set `self.error`) is the request's error: loud, never silent
        refused = grammar is not None and (self.error is not None if in_grammar else not grammar.advance(token))
        if refused:
            self.tracker.token_ids.append(token)
            self.tracker.finish_reason = "error"
            self.error = self.error or f"structured output: the grammar refused committed token {token} (a specgen bug)"
            return True
        if self.tracker.add(token):
            return True
        if grammar is not None and grammar.finished:
            self.tracker.finish_reason = "stop"
            return True
        return False


@dataclass(slots=True)
class RunTotals:
    requests: int = 0
    errors: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    prefill_calls: int = 0
    wall_seconds: float = 0.0
    # compilation and CUDA-graph capture at warm-up, and mid-run: a variant's first use, a recompile,
    # a CUDA graph recorded for a new kv bucket or draft window (pipelines/compile_clock.py)
    compile_seconds: float = 0.0
    step_seconds: float = 0.0        # the steps' iterations, admission (prefill) left out (inside wall_seconds)
    mask_seconds: float = 0.0        # structured output: the host's token masks (inside step_seconds)
    grammar_drafts: int = 0          # structured output: drafts the grammar wrote (its forced tokens)
    refused_drafts: int = 0          # structured output: slot-steps stopped at a draft the grammar refuses
    catch_ups: int = 0               # draft passes run alone, to keep a draft within its window (_issue)
    unabsorbed_prompts: int = 0      # prompts the draft did not read: drafting was ruled out (_admit)
    spec: SpecCounters = field(default_factory=lambda: SpecCounters(0))
    k_steps: list[int] = field(default_factory=list)    # steps run with each k (0 = plain)

    @property
    def tokens_per_second(self) -> float | None:
        return self.output_tokens / self.wall_seconds if self.wall_seconds > 0 else None

    @property
    def steady_tokens_per_second(self) -> float | None:
        """Throughput with the warm-up left out (what a longer job tends to)."""
        seconds = self.wall_seconds - self.compile_seconds
        return self.output_tokens / seconds if seconds > 0 else None


def completion_of(slot: Slot, markers: ReasoningMarkers | None, rules: StopRules) -> Completion:
    """The request's result: its tokens, its text (reasoning split off where `markers` are given)."""
    t = slot.tracker
    completion = Completion(slot.request.id, list(t.token_ids), "", t.finish_reason,
                            len(slot.request.prompt_ids), slot.counters, logprobs=slot.logprobs,
                            prompt_logprobs=slot.prompt_logprobs, error=slot.error)
    parts = split(t.token_ids, markers, slot.reasoning_start) if markers is not None else None
    if parts is None or (not parts.reasoning and len(parts.content) == len(t.token_ids)):
        completion.text = t.final_text()     # no reasoning and no marker: the text as decoded
        return completion
    decode = rules.decode
    reasoning, text = decode(parts.reasoning), decode(parts.content)
    if t.text is not None:
        # A stop string ended the request: it ends in the part that took the last token, so that
        # part is cut (searched near its end only: it was completed by the last token).
        tail = len(decode(t.token_ids[-2:])) + max(map(len, rules.stop_strings))
        if parts.ends_in_reasoning:
            reasoning = cut_at_stop(reasoning, rules.stop_strings, len(reasoning) - tail)
        else:
            text = cut_at_stop(text, rules.stop_strings, len(text) - tail)
    completion.text = text
    completion.reasoning_text = reasoning if parts.reasoning else None
    completion.num_reasoning_tokens = len(parts.reasoning)
    return completion
