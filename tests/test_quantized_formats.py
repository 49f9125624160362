"""Quantised checkpoints load to the numbers their published formats define, checked against a
reference this file writes itself in NumPy from the format descriptions (issue 68).

Contract checked here: a job's load of a quantised checkpoint (`load_target(config, folder,
dtype=float32, keep_fp8=False)`, and `load_draft("mtp", ...)` for DeepSeek's MTP layer) holds, in
every weight of the model, exactly the real values the checkpoint's bytes encode:

- DeepSeek-V3 block FP8 (`quant_method: fp8`, `fmt: e4m3`, the release's format, dequantised as in
  DeepSeek-V3's `inference/kernel.py` `weight_dequant`): `X.weight` is float8_e4m3fn `[O, I]`,
  `X.weight_scale_inv` float32 `[ceil(O / bo), ceil(I / bi)]` for `weight_block_size = [bo, bi]`;
  real `W[r, c] = fp8(X.weight[r, c]) * X.weight_scale_inv[r // bo, c // bi]`. The last block row and
  column may be partial (the release's `kv_a_proj_with_mqa` has 576 = 4.5 x 128 rows).
  e4m3fn ("fn": finite, NaN only): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
  is subnormal (m / 8 x 2^-6); S.1111.111 is NaN; there are no infinities; the largest value is 448.
- compressed-tensors `pack-quantized` (Kimi K2.5's routed experts: `num_bits 4`, `type int`,
  `symmetric`, `strategy group`, `group_size 32`): `X.weight_packed` int32 `[O, ceil(I / 8)]`,
  `X.weight_scale [O, ceil(I / g)]` (bf16 in the release), `X.weight_shape` = `[O, I]`. Along each row
  the 4-bit values form one dense little-endian bit stream: value i sits in word i // 8 at bits
  4 * (i % 8) .. 4 * (i % 8) + 3 (lowest bits first); a value v in [-8, 7] is stored as the unsigned
  nibble v + 8 (offset binary, not two's complement); real `W[r, c] = (nibble - 8) * scale[r, c // g]`.

The reference never calls specgen's dequantisers, compressed-tensors or torch's float8 casts (only
its self-check below compares with the latter): it parses the safetensors files itself (8-byte
little-endian header length, JSON header, raw little-endian data), decodes e4m3fn and bf16 from
their bits, unpacks the nibbles, and multiplies in float32. Both it and specgen form one float32
product of two float32 operands (an exactly converted e4m3 or int4 value, and the float32 or exactly
widened bf16 scale), rounded once by IEEE round-to-nearest-even, so the comparison is bitwise, with
no tolerance. (An FP8 product computed in float64 and rounded to float32 once is the same number:
4 + 24 significant bits fit float64's 53. For INT4 the float32 product is even exact: a 4-bit integer
times an 8-bit bf16 significand fits float32's 24 bits.)

Each loaded weight is mapped back to checkpoint keys the way specgen's loader fuses them (read from
models/layers.py `fuse_attention_and_mlp_keys` and models/moe.py `stack_expert_keys`): a dense or
shared-expert `gate_up_proj` is cat(gate_proj, up_proj) along rows; routed experts are stacked,
`experts.gate_up_proj[e]` = cat(experts.e.gate_proj, experts.e.up_proj), `experts.down_proj[e]` =
experts.e.down_proj; the MTP draft's `block.*` is the checkpoint's `model.layers.{N}.*`. Every
parameter the models hold is compared (plain float tensors too), and every quantised weight in the
checkpoint must have been compared.

The reference is itself checked: the e4m3fn decoder against torch's float8_e4m3fn -> float32 over all
256 bit patterns, the bf16 widening against torch's, and the INT4 unpacker against hand-packed words
(both nibble halves, a negative int32 word, a partial last word).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints_deepseek import (
    quantize_fp8,
    tiny_deepseek_config,
    tiny_kimi_config,
    write_deepseek_checkpoint,
    write_kimi_checkpoint,
)
from safetensors.torch import load_file, save_file

from specgen.checkpoints import read_config
from specgen.checkpoints.loading import load_draft, load_target

# --------------------------------------------------------------------------- the reference (NumPy)


def decode_e4m3fn(bits: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bit patterns (uint8) -> float32, from the format: sign, exponent (bias 7),
    mantissa (3 bits); exponent 0 is subnormal; S.1111.111 is NaN; no infinities."""
    bits = np.asarray(bits, dtype=np.uint8).astype(np.int64)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = bits & 0x7
    magnitude = np.where(exponent == 0,
                         np.ldexp(mantissa / 8.0, -6),                       # subnormal: 0.m x 2^(1-7)
                         np.ldexp(1.0 + mantissa / 8.0, exponent - 7))      # normal: 1.m x 2^(e-7)
    value = sign * magnitude                                                  # -0.0 for 0x80
    value = np.where((exponent == 0xF) & (mantissa == 0x7), np.nan, value)
    return value.astype(np.float32)                                           # every value is exact


def decode_bf16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32: bf16 is float32's top half."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def dequantize_block_fp8(weight_bits: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """DeepSeek's block FP8: element (r, c) times the multiplier of its block (r // bo, c // bi);
    edge blocks may be partial."""
    rows, cols = weight_bits.shape
    bo, bi = block
    assert scale_inv.shape == (-(-rows // bo), -(-cols // bi)), (scale_inv.shape, weight_bits.shape, block)
    per_element = scale_inv[(np.arange(rows) // bo)[:, None], (np.arange(cols) // bi)[None, :]]
    return decode_e4m3fn(weight_bits) * per_element.astype(np.float32)


def unpack_int4(packed: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """compressed-tensors pack-quantized, 4 bits: each row's values in one dense little-endian bit
    stream of int32 words (value i: word i // 8, bits 4 * (i % 8) upwards), stored as v + 8.
    Returns the signed values, int8 [O, I]."""
    rows, cols = shape
    assert packed.shape == (rows, -(-cols // 8)), (packed.shape, shape)
    words = packed.astype(np.int32).view(np.uint32).astype(np.uint64)            # the raw 32 bits
    column = np.arange(cols)
    nibbles = (words[:, column // 8] >> (4 * (column % 8)).astype(np.uint64)) & 0xF
    return (nibbles.astype(np.int16) - 8).astype(np.int8)


def dequantize_int4_groups(packed: np.ndarray, scale: np.ndarray, shape: tuple[int, int], group: int) -> np.ndarray:
    """Symmetric group INT4: each value times the scale of its group of `group` inputs."""
    rows, cols = shape
    assert scale.shape == (rows, -(-cols // group)), (scale.shape, shape, group)
    return unpack_int4(packed, shape).astype(np.float32) * scale[:, np.arange(cols) // group].astype(np.float32)


class RawCheckpoint:
    """A checkpoint folder's tensors as raw bytes, parsed from the safetensors format by hand."""

    DTYPES = {"F32": "<f4", "F64": "<f8", "I32": "<i4", "I64": "<i8", "U8": "u1", "BF16": "<u2", "F8_E4M3": "u1"}

    def __init__(self, folder: Path) -> None:
        self.tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
        for path in sorted(folder.glob("*.safetensors")):
            data = path.read_bytes()
            length = int.from_bytes(data[:8], "little")
            header = json.loads(data[8:8 + length])
            header.pop("__metadata__", None)
            for name, entry in header.items():
                begin, end = entry["data_offsets"]
                assert name not in self.tensors, f"{name} in two shards"
                self.tensors[name] = (entry["dtype"], tuple(entry["shape"]), data[8 + length + begin:8 + length + end])

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def dtype(self, name: str) -> str:
        return self.tensors[name][0]

    def raw(self, name: str) -> np.ndarray:
        dtype, shape, data = self.tensors[name]
        return np.frombuffer(data, dtype=self.DTYPES[dtype]).reshape(shape)

    def floats(self, name: str) -> np.ndarray:
        """A float tensor as float32 (bf16 widened, e4m3 decoded)."""
        dtype = self.dtype(name)
        if dtype == "BF16":
            return decode_bf16(self.raw(name))
        if dtype == "F8_E4M3":
            return decode_e4m3fn(self.raw(name))
        assert dtype == "F32", (name, dtype)
        return self.raw(name).astype(np.float32)


class Reference:
    """The real value of each checkpoint weight, by the published formats (the config says which)."""

    def __init__(self, folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
        self.block = tuple(quant["weight_block_size"]) if quant and quant["quant_method"] == "fp8" else None
        self.group = None
        if quant and quant["quant_method"] == "compressed-tensors":
            assert quant["format"] == "pack-quantized"
            (weights,) = {json.dumps(g["weights"], sort_keys=True) for g in quant["config_groups"].values()}
            weights = json.loads(weights)
            assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["strategy"]) == \
                (4, "int", True, "group")
            self.group = weights["group_size"]
        self.file = RawCheckpoint(folder)
        self.used: set[str] = set()

    def weight(self, name: str) -> np.ndarray:
        """`name` is an `X.weight` key of the checkpoint, quantised or not."""
        base = name.removesuffix("weight")
        if name + "_scale_inv" in self.file:
            assert self.file.dtype(name) == "F8_E4M3" and self.file.dtype(name + "_scale_inv") == "F32"
            self.used |= {name, name + "_scale_inv"}
            return dequantize_block_fp8(self.file.raw(name), self.file.raw(name + "_scale_inv"), self.block)
        if base + "weight_packed" in self.file:
            parts = [base + p for p in ("weight_packed", "weight_scale", "weight_shape")]
            assert name not in self.file and self.file.dtype(parts[0]) == "I32"
            self.used |= set(parts)
            shape = tuple(int(s) for s in self.file.raw(parts[2]))
            return dequantize_int4_groups(self.file.raw(parts[0]), self.file.floats(parts[1]), shape, self.group)
        self.used.add(name)
        return self.file.floats(name)

    def tensor(self, key: str, experts: int) -> np.ndarray:
        """The checkpoint's value for one of our (fused / stacked) tensors, under checkpoint key names."""
        if key.endswith("mlp.experts.gate_up_proj"):           # [E, 2I, H]: each expert's gate rows, then up
            base = key.removesuffix("gate_up_proj")
            return np.stack([np.concatenate((self.weight(f"{base}{e}.gate_proj.weight"),
                                             self.weight(f"{base}{e}.up_proj.weight"))) for e in range(experts)])
        if key.endswith("mlp.experts.down_proj"):              # [E, H, I]
            base = key.removesuffix("down_proj")
            return np.stack([self.weight(f"{base}{e}.down_proj.weight") for e in range(experts)])
        if key.endswith("gate_up_proj.weight"):                # dense MLP and shared experts: gate | up
            return np.concatenate((self.weight(key.replace("gate_up_proj", "gate_proj")),
                                   self.weight(key.replace("gate_up_proj", "up_proj"))))
        if key.endswith(".weight"):
            return self.weight(key)
        self.used.add(key)                                     # biases, e_score_correction_bias
        return self.file.floats(key)

    def quantised_weights(self) -> set[str]:
        return {n for n in self.file.tensors
                if n.endswith(("weight_scale_inv", "weight_packed", "weight_scale", "weight_shape"))
                or self.file.dtype(n) == "F8_E4M3"}


def assert_bitwise(name: str, ours: torch.Tensor, expected: np.ndarray) -> None:
    ours = ours.detach().cpu()
    assert ours.dtype == torch.float32, (name, ours.dtype)
    assert tuple(ours.shape) == expected.shape, (name, tuple(ours.shape), expected.shape)
    got = ours.numpy()
    same = got.view(np.uint32) == expected.astype(np.float32).view(np.uint32)
    if not same.all():
        where = tuple(int(i[0]) for i in np.nonzero(~same))
        raise AssertionError(f"{name}: {int((~same).sum())} of {same.size} elements differ from the format's "
                             f"value (max |diff| {np.nanmax(np.abs(got - expected)):.3g}; first at {where}: "
                             f"{got[where]!r} vs {expected[where]!r})")


def compare_model(module: torch.nn.Module, reference: Reference, to_checkpoint, experts: int) -> list[str]:
    """Every tensor `module` holds == the reference; returns the names compared."""
    names = []
    for name, tensor in module.state_dict().items():
        assert_bitwise(name, tensor, reference.tensor(to_checkpoint(name), experts))
        names.append(name)
    return names


# ------------------------------------------------------------------ the reference is itself checked


def test_e4m3fn_decoder_matches_torch_on_all_256_bit_patterns():
    bits = np.arange(256, dtype=np.uint8)
    ours = decode_e4m3fn(bits)
    theirs = torch.from_numpy(bits.copy()).view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(theirs)
    assert nan.nonzero()[0].tolist() == [0x7F, 0xFF]           # no infinities, two NaNs
    assert np.array_equal(np.isnan(ours), nan)
    assert np.array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))    # -0.0 too
    # landmarks of the format, independent of torch
    assert ours[0x7E] == 448 and ours[0xFE] == -448 and ours[0x38] == 1 and ours[0x01] == 2.0 ** -9
    assert ours[0x08] == 2.0 ** -6 and ours[0x07] == 7 * 2.0 ** -9 and np.signbit(ours[0x80])


def test_bf16_decoder_reads_float32s_top_half():
    values = torch.tensor([1.0, -2.5, 3.140625, 1e-30, -0.0, 65280.0, float("inf")], dtype=torch.bfloat16)
    ours = decode_bf16(values.view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(ours.view(np.uint32), values.float().numpy().view(np.uint32))


def test_int4_unpacker_reads_a_hand_packed_example():
    # Row 0: -8..7 in order, stored as nibbles 0..15, lowest bits first: 0x76543210, 0xFEDCBA98 (a
    # negative int32). Row 1: twelve values (a partial second word, upper nibbles zero padding):
    # 7, -1, 0, -8, 3, -3, 1, 2 -> nibbles F,7,8,0,B,5,9,A -> 0xA95B087F; then -2, 5, -7, 6 -> 6,D,1,E
    # -> 0x0000E1D6.
    row0 = np.array([0x76543210, 0xFEDCBA98 - 2**32], dtype=np.int32)
    assert unpack_int4(row0[None], (1, 16)).tolist() == [list(range(-8, 8))]
    row1 = np.array([[0xA95B087F - 2**32, 0x0000E1D6]], dtype=np.int32)
    assert unpack_int4(row1, (1, 12)).tolist() == [[7, -1, 0, -8, 3, -3, 1, 2, -2, 5, -7, 6]]
    # groups of 4 inputs, one scale each (bf16 bits of 0.5, 2.0, -0.25)
    scale = decode_bf16(np.array([[0x3F00, 0x4000, 0xBE80]], dtype=np.uint16))
    got = dequantize_int4_groups(row1, scale, (1, 12), 4)
    assert got.tolist() == [[3.5, -0.5, 0.0, -4.0, 6.0, -6.0, 2.0, 4.0, 0.5, -1.25, 1.75, -1.5]]


# ------------------------------------------------------------------------ DeepSeek-V3 block FP8

# the projections DeepSeek-V3's release stores in FP8 (its safetensors headers): every projection of
# the decoder blocks and the MTP block; embeddings, heads, norms, the router and eh_proj stay bf16
RELEASE_FP8 = re.compile(r"model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
                         r"|mlp\.(experts\.\d+\.|shared_experts\.)?(gate|up|down)_proj)\.weight")


def fp8_checkpoint(folder: Path, block: list[int]) -> Path:
    """A tiny DeepSeek-V3 FP8 checkpoint (MTP layer included) whose widths are not multiples of the
    block: hidden 72, intermediate 40, moe_intermediate 24, q_lora 24, kv_lora 32 + rope 8, so weights
    such as q_a_proj [24, 72], kv_a_proj_with_mqa [40, 72] and the experts' [24, 72] end in partial
    blocks along both dims. Every projection the release quantises is FP8 here (the shared writer
    leaves `kv_a_proj_with_mqa` unquantised; the release's is FP8, so it is quantised here), and the
    file is split as a sharded release is, each weight's scales in another shard than the weight."""
    config = tiny_deepseek_config(fp8=True, hidden_size=72, intermediate_size=40, moe_intermediate_size=24)
    config["quantization_config"]["weight_block_size"] = block
    write_deepseek_checkpoint(folder, config)
    state = load_file(str(folder / "model.safetensors"))
    for key in [k for k, t in state.items() if RELEASE_FP8.fullmatch(k) and t.dtype != torch.float8_e4m3fn]:
        state[key], state[key + "_scale_inv"] = quantize_fp8(state[key].float(), block)
    (folder / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": {k: v for k, v in state.items() if not k.endswith("_scale_inv")},
              "model-00002-of-00002.safetensors": {k: v for k, v in state.items() if k.endswith("_scale_inv")}}
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, tensors in shards.items() for k in tensors}}))
    return folder


@pytest.mark.parametrize("block", [[16, 16], [16, 32]], ids=["square-block", "16x32-block"])
def test_fp8_checkpoint_loads_to_the_published_block_dequantisation(tmp_path, block):
    """Square blocks as in the release (128 x 128 there, 16 here); a 16 x 32 block too, which the
    format allows (`weight_block_size` is [rows, cols]) and which tells a swapped block apart."""
    folder = fp8_checkpoint(tmp_path / "ds", block)
    config = read_config(folder)
    n, experts = config["num_hidden_layers"], config["n_routed_experts"]
    reference = Reference(folder)
    fp8 = {k for k in reference.file.tensors if reference.file.dtype(k) == "F8_E4M3"}
    assert fp8 == {k for k in reference.file.tensors if RELEASE_FP8.fullmatch(k)}
    ragged = [k for k in fp8 if all(d % b for d, b in zip(reference.file.tensors[k][1], block))]
    assert {"model.layers.0.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
            f"model.layers.{n}.mlp.experts.0.gate_proj.weight"} <= set(ragged)
    # the bytes span the format: both signs, nonzero subnormals, the largest finite value (each block's
    # largest magnitude is scaled to 448), and no NaN
    bits = np.concatenate([reference.file.raw(k).ravel() for k in fp8])
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    assert ((exponent == 0) & (mantissa != 0)).any() and {0x7E, 0xFE} <= set(bits.tolist())
    assert not ((exponent == 0xF) & (mantissa == 0x7)).any()

    target = load_target(config, folder, dtype=torch.float32, device="cpu", dummy=False, keep_fp8=False)
    compared = compare_model(target, reference, lambda name: name, experts)
    draft = load_draft("mtp", config, folder, target, num_speculative_tokens=1, dtype=torch.float32,
                       device="cpu", dummy=False)
    mtp = f"model.layers.{n}."
    compared += compare_model(draft, reference, lambda name: mtp + name.removeprefix("block."), experts)

    # every FP8 weight of the checkpoint, MTP layer included, was compared (the MTP layer's copies of
    # the embedding and head are the target's, which the draft shares rather than holds)
    assert reference.quantised_weights() <= reference.used
    unread = set(reference.file.tensors) - reference.used
    assert unread == {mtp + "embed_tokens.weight", mtp + "shared_head.head.weight"}
    assert "block.mlp.experts.gate_up_proj" in compared and "model.layers.0.mlp.gate_up_proj.weight" in compared
    # the weights compared are real data (not zeros, a constant, or integers)
    q_a = target.model.layers[0].self_attn.q_a_proj.weight
    assert len(torch.unique(q_a)) > 100 and not torch.equal(q_a, q_a.round())


# --------------------------------------------------------------------- Kimi K2.5 packed INT4


def test_kimi_int4_experts_load_to_the_published_unpacking(tmp_path):
    """Kimi K2.5's release layout (`language_model.` prefix, routed experts pack-quantized INT4 in
    groups of 32 with bf16 scales, everything else unquantised, a vision encoder left unread)."""
    config = tiny_kimi_config(int4=True)
    folder = write_kimi_checkpoint(tmp_path / "kimi", config)
    reference = Reference(folder)
    assert reference.group == 32
    packed = sorted(k for k in reference.file.tensors if k.endswith("weight_packed"))
    text = config["text_config"]
    moe_layers = text["num_hidden_layers"] - text["first_k_dense_replace"]
    assert len(packed) == moe_layers * text["n_routed_experts"] * 3 and all(".mlp.experts." in k for k in packed)
    assert {reference.file.dtype(k.replace("packed", "scale")) for k in packed} == {"BF16"}
    # the bytes exercise both sides of the offset and negative int32 words (the writer rounds to
    # [-7, 7], so nibble 0 (-8) appears only in the hand-packed example above)
    words = np.concatenate([reference.file.raw(k).ravel() for k in packed])
    nibbles = (words.view(np.uint32)[:, None] >> np.arange(0, 32, 4, dtype=np.uint32)) & 0xF
    assert (words < 0).any() and set(range(1, 16)) <= set(np.unique(nibbles).tolist())

    target = load_target(read_config(folder), folder, dtype=torch.float32, device="cpu", dummy=False, keep_fp8=False)
    compared = compare_model(target, reference, lambda name: "language_model." + name, text["n_routed_experts"])
    assert reference.quantised_weights() <= reference.used
    assert {k.split(".")[0] for k in set(reference.file.tensors) - reference.used} == {"vision_tower", "mm_projector"}
    assert "model.layers.1.mlp.experts.down_proj" in compared
