"""What a checkpoint holds, from its file headers alone: never a byte of tensor data.

Contract:
- `read_header(path)` -> {name: TensorHeader} parses one safetensors header (8-byte little-endian
  length, then JSON) and checks it against the file: a header that is not JSON, entries without
  dtype / shape / offsets, offsets that disagree with the shape or leave gaps, and a file shorter
  (truncated) or longer than the data its header describes are each a `CheckpointError` naming the
  file and the problem. Only the first 8 + header-length bytes are read, so a 600 GB checkpoint
  inspects in well under a second.
- `checkpoint_headers(folder)` does that for every weight file of a folder, through
  `model.safetensors.index.json` when there is one: a shard the index lists but the folder lacks,
  and a tensor the index places in a shard whose header lacks it, are errors too.
- The headers it returns are `TensorHeader`s (models/tensor_header.py, where the builders that
  accept them in place of tensors can see them without importing the loaders).
"""

from __future__ import annotations

import gc
import json
import math
import struct
from contextlib import contextmanager
from pathlib import Path

import torch

from specgen.checkpoints.store import CheckpointError, weight_files
from specgen.models.tensor_header import ShapeMismatch as ShapeMismatch
from specgen.models.tensor_header import TensorHeader as TensorHeader
from specgen.models.tensor_header import is_header_state as is_header_state

# safetensors dtype names -> torch dtypes (those torch has)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
_ITEM_BYTES = {k: v.itemsize for k, v in SAFETENSORS_DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000      # safetensors' own limit


def read_header(path: Path) -> dict[str, TensorHeader]:
    """One safetensors file's header, checked against the file's size (module docstring)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: not a safetensors file ({size} bytes, shorter than its "
                                      "8-byte header length)")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: corrupt or truncated header: it claims {length:,} bytes "
                                      f"but the file holds {size:,}")
            raw = f.read(length)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror or err}") from err
    try:
        entries = json.loads(raw)
        if not isinstance(entries, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: corrupt header: not valid JSON ({err})") from None
    entries.pop("__metadata__", None)
    tensors: dict[str, TensorHeader] = {}
    spans: list[tuple[int, int, str]] = []
    dtypes, item_bytes, prod = SAFETENSORS_DTYPES, _ITEM_BYTES, math.prod    # a hot loop: 10^5 entries
    for name, entry in entries.items():
        try:
            kind = entry["dtype"]
            dtype = dtypes[kind]
            shape = entry["shape"]
            start, stop = entry["data_offsets"]
            fits = stop - start == prod(shape) * item_bytes[kind] and start >= 0   # TypeError if not ints
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: corrupt header: tensor {name!r} has no valid dtype, shape and "
                                  f"data_offsets ({err!r})") from None
        if not fits or type(stop) is not int or any(type(n) is not int or n < 0 for n in shape):
            raise CheckpointError(f"{path}: corrupt header: tensor {name} spans bytes {start}..{stop}, "
                                  f"which does not fit its shape {shape} of {entry['dtype']}")
        tensors[name] = TensorHeader(shape, dtype, (name,))
        spans.append((start, stop, name))
    spans.sort()
    for (_, stop, before), (start, _, name) in zip(spans, spans[1:]):
        if start != stop:     # safetensors wants the data packed, in order, without gaps or overlaps
            raise CheckpointError(f"{path}: corrupt header: tensor {name} starts at byte {start} of the data, "
                                  f"but {before} ends at {stop}")
    if spans and spans[0][0] != 0:
        raise CheckpointError(f"{path}: corrupt header: the first tensor's data starts at byte {spans[0][0]}, not 0")
    end = spans[-1][1] if spans else 0
    if 8 + length + end > size:
        raise CheckpointError(f"{path}: truncated: its header describes {8 + length + end:,} bytes, "
                              f"the file holds {size:,}")
    if 8 + length + end < size:      # safetensors refuses these too ("file not fully covered")
        raise CheckpointError(f"{path}: corrupt: {size - 8 - length - end:,} bytes past the tensor data "
                              "its header describes")
    return tensors


_READ: dict[tuple, dict[str, TensorHeader]] = {}      # the last folders read, by their files' stat


def checkpoint_headers(folder: Path) -> dict[str, TensorHeader]:
    """Every tensor of a checkpoint folder by name, from its headers (module docstring). A folder
    whose files have not changed (names, sizes, mtimes) is read once per process: a run's checks,
    its draft's (MTP inside the target) and inspect all ask. The result is shared: do not mutate."""
    try:
        key = (str(folder.resolve()), tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns)
                                            for p in sorted(folder.glob("*.safetensors*"))))
    except OSError:
        key = None
    if key is not None and key in _READ:
        return _READ[key]
    with without_gc():
        tensors = _read_headers(folder)
    if key is not None:
        if len(_READ) >= 4:
            _READ.pop(next(iter(_READ)))
        _READ[key] = tensors
    return tensors


@contextmanager
def without_gc():
    """Header work makes 10^5 small objects and no cycles: the collections they would trigger find
    nothing to free and take most of the time (a second for DeepSeek-V3's 92k tensors)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _read_headers(folder: Path) -> dict[str, TensorHeader]:
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        tensors: dict[str, TensorHeader] = {}
        for path in weight_files(folder):
            tensors.update(read_header(path))
        return tensors
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index}: not a valid shard index ({err!r})") from None
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    tensors = {}
    for shard, names in sorted(shards.items()):
        path = folder / shard
        if not path.is_file():
            raise CheckpointError(f"{path}: missing: {index.name} places {len(names)} tensors in it "
                                  f"(e.g. {names[0]})")
        header = read_header(path)
        absent = [n for n in names if n not in header]
        if absent:
            raise CheckpointError(f"{path}: {index.name} places {absent[0]} in this file, but its header "
                                  f"lacks it{f' (and {len(absent) - 1} more)' if len(absent) > 1 else ''}")
        tensors.update(header)      # as a real load reads them: every tensor of every listed shard
    return tensors
