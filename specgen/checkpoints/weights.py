"""Reading tensors from safetensors files (single or sharded), straight to the run's device and dtype.

Contract: `read_tensors(files, device=..., dtype=...)` returns the tensors of the files keyed by
name (optionally those under a prefix, optionally stripped of it). Each tensor is read onto `device`
(`safe_open(device=...)`) and cast to `dtype` at once when floating, one tensor at a time, so the
checkpoint never sits in memory twice. `tensor_names(folder)` reads headers only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specgen.checkpoints.store import CheckpointError, weight_files


def read_tensors(files: list[Path], *, prefix: str = "", strip_prefix: bool = False,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    if key.startswith(prefix):
                        tensor = f.get_tensor(key)
                        if dtype is not None and tensor.is_floating_point():
                            tensor = tensor.to(dtype)
                        state[key[len(prefix):] if strip_prefix else key] = tensor
        except (OSError, RuntimeError, ValueError) as err:
            raise CheckpointError(f"{path}: cannot read safetensors: {err}") from err
    return state


def tensor_names(folder: Path) -> list[str]:
    """Every tensor name in the checkpoint folder, from the shard index or the file headers."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:   # reads the header only
                names.extend(f.keys())
        except (OSError, RuntimeError, ValueError) as err:
            raise CheckpointError(f"{path}: cannot read safetensors: {err}") from err
    return names
