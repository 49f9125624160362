"""A GGUF's own blocks (checkpoints/gguf_blocks.py) against the ggml formats written out here from
their definitions, one block at a time with `struct`, and kept as torch's int4 pack
(models/quantized.published_weight) with the codes exact and only each block's scale and offset
rounded to bf16. The embedded SmolLM2 GGUF's every tensor is test_smollm2.py's."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from specgen.checkpoints.gguf_blocks import decode_blocks, unpermute_rows
from specgen.models.quantized import QuantizedEmbedding, published_weight


def ggml_rows(fmt: str, rows: int, blocks: int, seed: int = 0):
    """(raw bytes [rows, blocks x size] uint8, the real weights [rows, 32 blocks] float64) of random
    blocks written by ggml's definitions: Q4_0 {fp16 d; 16 bytes: weight j low nibble of byte j,
    weight j + 16 high nibble} = (q - 8) d; Q4_1 {fp16 d, m; the same nibbles} = q d + m; Q8_0
    {fp16 d; 32 int8} = q d."""
    rng = np.random.default_rng(seed)
    raw, real = [], []
    for _ in range(rows):
        row_bytes, row_real = b"", []
        for _ in range(blocks):
            d = float(np.float16(rng.uniform(0.001, 0.05)))
            if fmt == "Q8_0":
                q = rng.integers(-128, 128, 32)
                row_bytes += struct.pack("<e32b", d, *q)
                row_real += [int(v) * d for v in q]
                continue
            q = rng.integers(0, 16, 32)
            nibbles = bytes(int(q[j]) | int(q[j + 16]) << 4 for j in range(16))
            if fmt == "Q4_0":
                row_bytes += struct.pack("<e", d) + nibbles
                row_real += [(int(v) - 8) * d for v in q]
            else:
                m = float(np.float16(rng.uniform(-0.4, 0.1)))
                row_bytes += struct.pack("<ee", d, m) + nibbles
                row_real += [int(v) * d + m for v in q]
        raw.append(np.frombuffer(row_bytes, dtype=np.uint8))
        real.append(row_real)
    return np.stack(raw), torch.tensor(real, dtype=torch.float64)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_decode_to_the_formats_values_exactly(fmt):
    raw, real = ggml_rows(fmt, rows=6, blocks=3)
    blocks = decode_blocks(raw, fmt)
    assert blocks.codes.shape == (6, 96) and blocks.scales.shape == (6, 3)
    assert torch.equal(blocks.dequantized(), real)


def test_q_and_k_rows_go_back_to_the_order_llama_cpp_permuted_them_from():
    """llama.cpp's converter: rows (heads, 2, half) -> (heads, half, 2) ("permute" in its
    convert_hf_to_gguf.py); undoing it must give the original order back."""
    raw, _ = ggml_rows("Q4_1", rows=16, blocks=1)
    original = decode_blocks(raw, "Q4_1")
    heads, half = 2, 4
    permuted = original.rows(torch.arange(16).view(heads, 2, half).transpose(1, 2).reshape(16))
    assert torch.equal(unpermute_rows(permuted, heads).codes, original.codes)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1"])
def test_four_bit_blocks_keep_their_codes_in_torchs_int4_pack(fmt):
    """The product's weights (read back through torch's own kernel) differ from the GGUF's only by
    each block's scale and offset in bf16 (8 significant bits: within 2^-8 of each): at most
    8 x 2^-8 d + 2^-8 |offset| a weight."""
    raw, real = ggml_rows(fmt, rows=16, blocks=4, seed=3)   # torch packs multiples of 16 rows
    blocks = decode_blocks(raw, fmt)
    weight = published_weight([blocks], None)
    assert weight.kind == "int4"
    repeat = lambda t: t.double().repeat_interleave(32, dim=1)       # noqa: E731
    bound = 8 * 2**-8 * repeat(blocks.scales) + 2**-8 * repeat(blocks.offsets).abs() + 1e-12
    error = (weight.dequantized().double() - real).abs()
    assert (error <= bound).all()
    assert error.max() > 0 or fmt == "Q4_0"          # Q4_1's offsets really are rounded


def test_an_eight_bit_embedding_is_looked_up_exactly():
    raw, real = ggml_rows("Q8_0", rows=10, blocks=2, seed=5)
    blocks = decode_blocks(raw, "Q8_0")
    embedding = QuantizedEmbedding(blocks.codes - 8, blocks.scales, blocks.offsets, torch.float32)
    tokens = torch.tensor([[3, 0, 9], [9, 9, 1]])
    assert torch.equal(embedding(tokens).double(), real[tokens])
