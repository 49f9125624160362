"""A GGUF's own quantized blocks, read as they are stored: what `target.quantization` keeps of a GGUF
target instead of quantizing its dequantised weights again.

Contract: `published_blocks(gguf, config)` gives every Llama-family weight stored as Q4_0, Q4_1 or
Q8_0 (ggml's block formats, 32 weights a block, from the file's bytes with no float round trip) by the
HF tensor name transformers' conversion gives it (`model.layers.{i}.self_attn.q_proj.weight`,
`model.embed_tokens.weight`, `lm_head.weight`), as `Blocks`: integer codes [rows, cols] and per-block
scale and offset [rows, cols / 32] with real weight = (code - 8) x scale + offset. It is a mapping that
decodes a tensor when it is asked for (the file is memory-mapped): a caller that packs one weight at a
time holds one decoded weight at a time.
That is exactly the GGUF's value, in every format:
  Q4_0  18 bytes: d (fp16), 16 bytes of nibbles        w = (q - 8) d          code q, scale d, offset 0
  Q4_1  20 bytes: d, m (fp16), 16 bytes of nibbles     w = q d + m            code q, scale d, offset m + 8 d
  Q8_0  34 bytes: d (fp16), 32 int8                    w = q d                code q + 8, scale d, offset 0
A block's nibbles hold weight j in the low four bits of byte j and weight j + 16 in the high four
(ggml's order). llama.cpp's converter permutes the rows of Q and K for its RoPE layout; they are put
back as transformers puts back the dequantised ones (`unpermute_rows`), whole rows at a time, so the
codes never change. Anything else (K-quants, F16, F32) is not returned: it is loaded dequantised as
before. tests/test_gguf_blocks.py checks every returned tensor against transformers' own dequantised
weights of the embedded SmolLM2 GGUF.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

GROUP = 32
GGUF_SOURCE = "specgen_source"     # the key the converted folder's config.json names its GGUF under

# ggml block layouts: bytes per block of 32 weights
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight$")
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


@dataclass
class Blocks:
    """One weight's blocks: w[r, c] = (codes[r, c] - 8) x scales[r, c // 32] + offsets[r, c // 32]."""
    format: str                # "Q4_0" | "Q4_1" | "Q8_0"
    codes: torch.Tensor        # [rows, cols] uint8 0..15 (4-bit formats); int16 -120..135 (Q8_0: q + 8)
    scales: torch.Tensor       # [rows, cols / 32] float32 (an fp16 value, exact)
    offsets: torch.Tensor      # [rows, cols / 32] float64 (Q4_1's m + 8 d needs up to 26 bits; else 0)

    @property
    def bits(self) -> int:
        return 8 if self.format == "Q8_0" else 4

    def dequantized(self) -> torch.Tensor:
        """The GGUF's real weights [rows, cols], in float64 (exact)."""
        repeat = lambda t: t.double().repeat_interleave(GROUP, dim=1)   # noqa: E731
        return (self.codes.double() - 8) * repeat(self.scales) + repeat(self.offsets)

    def rows(self, index: torch.Tensor) -> Blocks:
        return Blocks(self.format, self.codes[index], self.scales[index], self.offsets[index])


def hf_name(gguf_name: str) -> str | None:
    """The HF tensor name of a GGUF Llama tensor (None: not a weight specgen repacks)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    match = _LAYER.match(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    return None


def decode_blocks(raw: np.ndarray, fmt: str) -> Blocks:
    """ggml blocks -> `Blocks`. raw: [rows, blocks x BLOCK_BYTES[fmt]] uint8 (a GGUF tensor's data)."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, BLOCK_BYTES[fmt])
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)          # [rows, nb]
    offset = np.zeros(scale.shape, dtype=np.float64)
    if fmt == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).astype(np.int16) + 8                  # [rows, nb, 32]
    else:
        start = 2 if fmt == "Q4_0" else 4
        packed = blocks[..., start:start + 16]                                          # [rows, nb, 16]
        q = np.concatenate((packed & 0xF, packed >> 4), axis=-1)                        # weights 0..15, 16..31
        if fmt == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
            offset = m + 8 * scale.astype(np.float64)       # exact in float64, rounded by the product's layout
    codes = torch.from_numpy(np.ascontiguousarray(q.reshape(rows, -1)))
    return Blocks(fmt, codes, torch.from_numpy(scale), torch.from_numpy(offset))


def unpermute_rows(blocks: Blocks, heads: int) -> Blocks:
    """Undo llama.cpp's row permutation of Q / K (its RoPE pairs interleaved), as transformers does
    for the dequantised weights: rows (heads, 2, half) -> (heads, half, 2)."""
    rows = blocks.codes.shape[0]
    half = rows // heads // 2
    # stored row (h, j, s) of (heads, half, 2) is the HF row (h, s, j) of (heads, 2, half)
    return blocks.rows(torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows))


def block_tensors(gguf: Path) -> dict:
    """{HF name: the GGUF's tensor (memory-mapped)} of every weight stored in a format `decode_blocks` reads."""
    from gguf import GGUFReader

    return {hf_name(t.name): t for t in GGUFReader(str(gguf)).tensors
            if t.tensor_type.name in BLOCK_BYTES and hf_name(t.name) is not None}


class PublishedBlocks(Mapping):
    """`published_blocks`' result: HF name -> `Blocks`, each decoded when asked for."""

    def __init__(self, gguf: Path, config: dict) -> None:
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads") or self.heads)
        self.tensors = block_tensors(gguf)

    def __getitem__(self, name: str) -> Blocks:
        tensor = self.tensors[name]
        blocks = decode_blocks(np.asarray(tensor.data), tensor.tensor_type.name)
        if name.endswith("q_proj.weight"):
            return unpermute_rows(blocks, self.heads)
        if name.endswith("k_proj.weight"):
            return unpermute_rows(blocks, self.kv_heads)
        return blocks

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def published_blocks(gguf: Path, config: dict) -> PublishedBlocks:
    """Every Q4_0 / Q4_1 / Q8_0 weight of a Llama-family GGUF, by HF name (see the module docstring)."""
    return PublishedBlocks(gguf, config)


def published_formats(gguf: Path) -> dict[str, tuple[str, int]]:
    """{HF name: (block format, weights)} of what `published_blocks` returns, from the GGUF's header
    alone (the memory estimate's)."""
    return {name: (t.tensor_type.name, int(np.prod(t.shape))) for name, t in block_tensors(gguf).items()}


def gguf_source(config: dict) -> Path | None:
    """The GGUF file a converted folder came from (None for any other checkpoint, or where it moved)."""
    source = config.get(GGUF_SOURCE)
    return Path(source) if source and Path(source).is_file() else None
