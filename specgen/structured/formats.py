"""What a job asks its outputs to be: `sampling.response_format` in a recipe, or a prompt line's own
`response_format` (which wins, as in OpenAI's batch files).

Contract: `parse_response_format(value, where)` -> a `ResponseFormat`, or None for no constraint, or
`FormatError` naming the place (`recipe.sampling.response_format.type: ...`). Accepted forms (OpenAI's
and vLLM's spellings):
- `{type: json_schema, schema: {...}}`, or OpenAI's `{type: json_schema, json_schema: {schema: {...}}}`;
- `{type: json_object}`: any JSON object;
- `{type: regex, pattern: "..."}`;
- `{type: choice, choices: ["a", "b", ...]}`: exactly one of the strings;
- `{type: grammar, lark: "..."}` or `{type: grammar, ebnf: "..."}` (xgrammar's EBNF, GBNF-like);
- `{type: text}`: no constraint (a `ResponseFormat` of kind text: a prompt line's turns the recipe's off).
Only the shape is checked here; whether a schema, pattern or grammar compiles is the grammar engine's
to say, per request (grammar.py): a malformed one fails that prompt alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "text")


class FormatError(ValueError):
    """A response_format of the wrong shape: `place` (the field) and `problem`."""

    def __init__(self, place: str, problem: str) -> None:
        super().__init__(f"{place}: {problem}")
        self.place, self.problem = place, problem


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    kind: str        # json_schema | json_object | regex | choice | lark | ebnf | text
    source: str      # the schema (as JSON), pattern, choices (a JSON list) or grammar text

    @property
    def constrains(self) -> bool:
        return self.kind != "text"


def parse_response_format(value: Any, where: str) -> ResponseFormat | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FormatError(where, f"expected a mapping with a 'type', got {type(value).__name__}")
    kind = value.get("type")
    if kind not in KINDS:
        raise FormatError(where + ".type", f"expected one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "text":          # explicit: no constraint (a prompt line's overrides the recipe's)
        return ResponseFormat("text", "")
    if kind == "json_object":
        return ResponseFormat("json_object", "")
    if kind == "json_schema":
        schema = value.get("schema")
        place = f"{where}.schema"
        if schema is None and isinstance(value.get("json_schema"), dict):
            schema, place = value["json_schema"].get("schema"), f"{where}.json_schema.schema"
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise FormatError(place, f"not valid JSON ({err.msg})") from None
        if not isinstance(schema, dict | bool):
            raise FormatError(place, f"expected a JSON schema (an object), got {_name(schema)}")
        # key order kept: the engine writes properties in the schema's order
        return ResponseFormat("json_schema", json.dumps(schema))
    if kind == "regex":
        pattern = value.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise FormatError(where + ".pattern", f"expected a non-empty string, got {_name(pattern)}")
        return ResponseFormat("regex", pattern)
    if kind == "choice":
        choices = value.get("choices")
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) and c for c in choices)):
            raise FormatError(where + ".choices", f"expected a non-empty list of non-empty strings, got "
                              f"{_name(choices)}")
        return ResponseFormat("choice", json.dumps(choices))
    given = [name for name in ("lark", "ebnf") if name in value]
    if len(given) != 1:
        raise FormatError(where, "a grammar needs exactly one of 'lark' or 'ebnf'")
    text = value[given[0]]
    if not isinstance(text, str) or not text.strip():
        raise FormatError(f"{where}.{given[0]}", f"expected the grammar's text, got {_name(text)}")
    return ResponseFormat(given[0], text)


def _name(value: Any) -> str:
    return "nothing" if value is None else repr(value)[:60]
