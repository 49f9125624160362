"""Stop handling: incremental detokenisation equals a full decode, and costs O(new tokens) per token."""

from __future__ import annotations

import random

import pytest

from specgen.checkpoints.tokenizer import ByteTokenizer
from specgen.pipelines.stops import OutputTracker, StopRules


class CountingDecode:
    """A tokenizer's decode that counts the tokens it was asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.tokens = tokenizer, 0

    def __call__(self, ids: list[int]) -> str:
        self.tokens += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def byte_ids(text: str) -> list[int]:
    return ByteTokenizer(300).encode(text)[1:]     # without the BOS


def tracker_for(stops, decode, max_tokens=10_000):
    return OutputTracker(StopRules(frozenset(), tuple(stops), False, decode), max_tokens=max_tokens)


def test_incremental_text_equals_the_full_decode_across_split_characters():
    text = "naïve café — 日本語 ok 🙂 done"                 # multi-byte characters split over tokens
    decode = CountingDecode(ByteTokenizer(300))
    tracker = tracker_for(["never-there"], decode)
    for token in byte_ids(text):
        assert not tracker.add(token)
    assert tracker._decoded == text
    assert decode.tokens < 12 * len(byte_ids(text))     # a short window per token, not the whole output


def test_a_stop_string_split_over_tokens_ends_at_the_token_that_completes_it():
    ids = byte_ids("alpha beta\n\ngamma")
    tracker = tracker_for(["\n\n"], CountingDecode(ByteTokenizer(300)))
    finished_at = next(i for i, t in enumerate(ids) if tracker.add(t))
    assert ids[finished_at] == ord("\n") + 3 and tracker.finish_reason == "stop"
    assert tracker.final_text() == "alpha beta"


def test_stop_before_max_tokens_inside_one_block():
    ids = byte_ids("ab STOP cd")
    tracker = tracker_for(["STOP"], CountingDecode(ByteTokenizer(300)), max_tokens=7)
    results = [tracker.add(t) for t in ids[:7]]
    assert results.index(True) == 6 and tracker.finish_reason == "stop"   # "STOP" ends at token 7


@pytest.mark.slow
def test_incremental_text_equals_the_full_decode_on_smollm2():
    from transformers import AutoTokenizer

    from specgen.checkpoints import resolve_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(resolve_checkpoint("smollm2-135m-instruct"))
    rng = random.Random(0)
    texts = ["Hello there, how are you?\n\n- item one\n- item two", "def f(x):\n    return x ** 2  # ok",
             "Ünïcödé and emoji 🙂🙂 and 中文字符 mixed"]
    for text in texts:
        ids = tokenizer.encode(text)
        ids += [rng.randrange(tokenizer.vocab_size) for _ in range(40)]   # arbitrary tokens too
        decode = CountingDecode(tokenizer)
        tracker = tracker_for(["never-there"], decode)
        for token in ids:
            tracker.add(token)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert full.startswith(tracker._decoded) and len(full) - len(tracker._decoded) <= 2
        assert decode.tokens < 12 * len(ids)
