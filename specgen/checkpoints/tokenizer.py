"""Tokenizers: the checkpoint's own (transformers), or a byte-level stand-in for dummy checkpoints.

A `load_format: dummy` target built from a bare config.json has no tokenizer files; the stand-in maps
UTF-8 bytes to ids 3..258 so that prompts still turn into ids and back. Its outputs are meaningless
text by construction, and the run says so.
"""

from __future__ import annotations

import json
from pathlib import Path

from specgen.checkpoints.store import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "tiktoken.model")


class ByteTokenizer:
    """UTF-8 bytes as tokens (offset 3; 0 = pad, 1 = bos, 2 = eos), no chat template."""

    chat_template = None
    eos_token_id = 2
    offset = 3

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [1] + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")


def has_tokenizer(folder: Path | None) -> bool:
    return folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer(folder: Path | None) -> None:
    """Refuse, before any weights load, a tokenizer only the checkpoint's own code can read (Kimi K2 /
    K2.5 ship `tiktoken.model` + `tokenization_kimi.py`): specgen never runs a checkpoint's code."""
    if not has_tokenizer(folder) or (folder / "tokenizer.json").is_file():
        return
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{config_path}: cannot read: {err}") from err
    remote = (config.get("auto_map") or {}).get("AutoTokenizer")
    if remote:
        code = remote[0] if isinstance(remote, list) else remote
        raise CheckpointError(
            f"{folder}: the tokenizer is defined by the checkpoint's own code ({code}), which specgen "
            "never runs. Provide a tokenizer.json in the folder: a tiktoken.model converts with "
            "transformers.integrations.tiktoken.convert_tiktoken_to_fast (needs the tiktoken "
            "package), keeping the special tokens listed in tokenizer_config.json.")


def load_tokenizer(folder: Path | None, vocab_size: int):
    if not has_tokenizer(folder):
        return ByteTokenizer(vocab_size)
    check_tokenizer(folder)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder}: transformers cannot load the tokenizer without running remote "
                              f"code or downloading: {err}") from err
