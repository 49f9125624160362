"""Header-only checkpoints at FULL size, from the weight layouts in tests/layouts.

Each file holds a real safetensors header (every key, shape and dtype of the reference layout, the
real sharding with its `model.safetensors.index.json`) followed by a SPARSE data region: the file
has its full length, so nothing looks truncated, but no byte of it is stored, and reading it would
only give zeros. A 680 GB DeepSeek-V3 copy takes a few MB of disk.

The layouts are written from the reference files alone (this module does not import specgen), so
the checks under test never check themselves. Broken variants (`break_*`) edit a written copy.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
from pathlib import Path

from checkpoints import LAYOUTS_DIR

ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
              "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

# name -> (config file, weights file, shards)
LAYOUTS = {
    "llama-3.1-8b": ("meta-llama__Llama-3.1-8B-Instruct.config.json",
                     "weights__meta-llama__Llama-3.1-8B-Instruct.json", 4),
    "deepseek-v3": ("deepseek-ai__DeepSeek-V3.config.json", "weights__deepseek-ai__DeepSeek-V3.REPRESENTATIVE.json", 163),
    "kimi-k2.5": ("moonshotai__Kimi-K2.5.config.RECONSTRUCTED-raw.json",
                  "weights__moonshotai__Kimi-K2.5.FROM-HEADER-DUMP.json", 64),
    "eagle3-llama3.1-8b": ("yuhuili__EAGLE3-LLaMA3.1-Instruct-8B.config.json",
                           "weights__yuhuili__EAGLE3-LLaMA3.1-Instruct-8B.json", 1),
    "kimi-k2.5-eagle3": ("nvidia__Kimi-K2.5-Thinking-Eagle3.config.RECONSTRUCTED.json",
                         "weights__nvidia__Kimi-K2.5-Thinking-Eagle3.DERIVED.json", 1),
    "dflash-qwen3-8b": ("z-lab__Qwen3-8B-DFlash-b16.config.json", "weights__z-lab__Qwen3-8B-DFlash-b16.json", 1),
}
TARGETS = ("llama-3.1-8b", "deepseek-v3", "kimi-k2.5")


def layout(name: str) -> tuple[dict, dict[str, tuple[list[int], str]]]:
    """(config, {key: (shape, dtype)}) of a reference layout, every pattern expanded."""
    config_file, weights_file, _ = LAYOUTS[name]
    config = json.loads((LAYOUTS_DIR / config_file).read_text())
    tensors: dict[str, tuple[list[int], str]] = {}
    for key, (shape, dtype) in json.loads((LAYOUTS_DIR / weights_file).read_text())["tensors"].items():
        for expanded in _ranges(key):
            tensors[expanded] = (list(shape), dtype)
    if name == "deepseek-v3":
        tensors = _deepseek_every_layer(tensors, config)
    return config, tensors


def _ranges(key: str) -> list[str]:
    """`a.{0-2}.b` -> a.0.b, a.1.b, a.2.b (every `{lo-hi}` in the key)."""
    spans = [range(int(lo), int(hi) + 1) for lo, hi in re.findall(r"\{(\d+)-(\d+)\}", key)]
    if not spans:
        return [key]
    template = re.sub(r"\{\d+-\d+\}", "{}", key)
    return [template.format(*values) for values in itertools.product(*spans)]


def _deepseek_every_layer(shown: dict, config: dict) -> dict:
    """The representative DeepSeek-V3 listing (its _meta): layer 0 stands for the dense layers,
    layer 3 for the MoE ones, expert 0 for every expert; layer 61 is the MTP module."""
    dense, layers, experts = config["first_k_dense_replace"], config["num_hidden_layers"], config["n_routed_experts"]
    out: dict = {}
    for key, value in shown.items():
        if ".experts.255." in key:
            continue                           # listed as an example of the expert pattern
        m = re.match(r"model\.layers\.(\d+)\.(.*)", key)
        indices = [None]
        if m and int(m.group(1)) == 0:
            indices = range(dense)
        elif m and int(m.group(1)) == 3:
            indices = range(dense, layers)
        for i in indices:
            name = key if i is None else f"model.layers.{i}.{m.group(2)}"
            for e in (range(experts) if ".experts.0." in name else [None]):
                out[name if e is None else name.replace(".experts.0.", f".experts.{e}.")] = value
    return out


def write_header_only(folder: Path, config: dict, tensors: dict[str, tuple[list[int], str]],
                      shards: int = 1) -> Path:
    """The checkpoint folder: config.json and header-only sparse safetensors (module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    names = list(tensors)
    per_shard = -(-len(names) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        part = names[s * per_shard:(s + 1) * per_shard]
        file = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in part:
            shape, dtype = tensors[name]
            size = ITEM_BYTES[dtype]
            for n in shape:
                size *= n
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)     # sparse: the data region is never written
        total += offset
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def write_layout(root: Path, name: str) -> Path:
    config, tensors = layout(name)
    return write_header_only(root / name, config, tensors, LAYOUTS[name][2])


def header_bytes(folder: Path) -> int:
    """The bytes a header-only reader needs: 8 + header length of every weight file."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with open(path, "rb") as f:
            total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


# --------------------------------------------------------------------------------- broken variants


def first_file(folder: Path) -> Path:
    return sorted(folder.glob("*.safetensors"))[0]


def break_missing_shard(folder: Path) -> str:
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    return shard.name


def break_truncate(folder: Path) -> str:
    path = first_file(folder)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 1)
    return path.name


def break_garbage_header(folder: Path) -> str:
    path = first_file(folder)
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{{{")
    return path.name


def break_offsets(folder: Path) -> str:
    """A gap in the data: the second tensor starts 8 bytes after the first one ends."""
    path = first_file(folder)
    header = _header_of(path)
    second = [k for k in header if k != "__metadata__"][1]
    header[second]["data_offsets"] = [o + 8 for o in header[second]["data_offsets"]]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    size = path.stat().st_size - 8 - struct.unpack("<Q", open(path, "rb").read(8))[0]
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + size)
    return path.name


def break_index(folder: Path) -> str:
    """The index places a tensor in a shard whose header does not hold it."""
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.layers.0.ghost.weight"] = sorted(set(data["weight_map"].values()))[0]
    index.write_text(json.dumps(data))
    return index.name


def break_truncated_header(folder: Path) -> str:
    """The file ends inside its own header."""
    path = first_file(folder)
    with open(path, "r+b") as f:
        length = struct.unpack("<Q", f.read(8))[0]
        f.truncate(8 + length // 2)
    return path.name


def _header_of(path: Path) -> dict:
    with open(path, "rb") as f:
        return json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))


def edit_header(folder: Path, edit, holding: str | None = None) -> None:
    """Rewrite the header of the file holding tensor `holding` (the first file when None) through
    `edit(header dict)`; offsets are recomputed and the file resized to match (a consistent file)."""
    files = sorted(folder.glob("*.safetensors"))
    path = next(p for p in files if holding is None or holding in _header_of(p))
    header = _header_of(path)
    edit(header)
    offset = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        size = ITEM_BYTES[entry["dtype"]]
        for n in entry["shape"]:
            size *= n
        entry["data_offsets"] = [offset, offset + size]
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if v != path.name or k in header}
        data["weight_map"].update({k: path.name for k in header if k != "__metadata__"})
        index.write_text(json.dumps(data))


if __name__ == "__main__":
    # `python tests/header_checkpoints.py OUT [NAME ...]`: write full-size header-only copies (a few MB
    # of disk each) to inspect by hand, e.g. `specgen inspect-checkpoint OUT/deepseek-v3`.
    import sys

    out, names = Path(sys.argv[1]), sys.argv[2:] or list(LAYOUTS)
    for name in names:
        print(write_layout(out, name))
