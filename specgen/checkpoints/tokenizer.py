"""Tokenizers: the checkpoint's own (transformers), or a byte-level stand-in for dummy checkpoints.

A `load_format: dummy` target built from a bare config.json has no tokenizer files; the stand-in maps
UTF-8 bytes to ids 3..258 so that prompts still turn into ids and back. Its outputs are meaningless
text by construction, and the run says so.
"""

from __future__ import annotations

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return data.decode("utf-8", errors="replace")


def has_tokenizer(folder: Path | None) -> bool:
    return folder is not None and any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(folder: Path | None, vocab_size: int):
    """The checkpoint's tokenizer through transformers, never running the checkpoint's own code:
    a `tokenizer.json`, a sentencepiece model, or Kimi's `tiktoken.model` (converted by transformers
    with the tiktoken package; its `tokenization_kimi.py` is not needed). A tokenizer that only
    remote code can read is a `CheckpointError` saying what to provide."""
    if not has_tokenizer(folder):
        return ByteTokenizer(vocab_size)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, ImportError) as err:
        raise CheckpointError(
            f"{folder}: transformers cannot load this tokenizer without running the checkpoint's own code "
            f"({err}). specgen never runs it: put a tokenizer.json in the folder (a tokenizer saved by "
            "transformers' save_pretrained), or a tiktoken.model with its tokenizer_config.json.") from err
