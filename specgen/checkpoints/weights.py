"""Reading tensors from safetensors files (single or sharded), straight to the run's device and dtype.

Contract: `read_tensors(files, device=..., dtype=...)` returns the tensors of the files keyed by
name (optionally those under a prefix, optionally stripped of it). Each tensor is read onto `device`
(`safe_open(device=...)`) and cast to `dtype` at once when floating, one tensor at a time, so the
checkpoint never sits in memory twice. Quantised weights (DeepSeek's block FP8, Kimi's packed INT4:
checkpoints/quantized.py) are kept as stored until the whole read is done, then dequantised to
`dtype`, whichever shards a weight and its scales sit in.
`read_tensor_headers(folder, ...)` is the same read with `TensorHeader`s in place of tensors (the
file headers only, checkpoints/headers.py): what a dry load checks. `tensor_names(folder)` reads
headers only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specgen.checkpoints.headers import checkpoint_headers
from specgen.checkpoints.quantized import Quantization, dequantize_state, is_quantized_part
from specgen.checkpoints.store import CheckpointError
from specgen.models.materialise import keeps_float32


def read_tensors(files: list[Path], *, prefix: str = "", strip_prefix: bool = False,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 quantization: Quantization | None = None,
                 reads: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """`quantization`: what the config says (quantized.quantization_of); None reads shapes from scales.
    `reads(name)`: False for tensors to leave in the file (a text-only run's vision encoder)."""
    state: dict[str, torch.Tensor] = {}
    quantized = False
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    if key.startswith(prefix) and (reads is None or reads(key)):
                        quantized |= _place(state, key, f.get_tensor(key), prefix if strip_prefix else "", dtype)
        except (OSError, RuntimeError, ValueError, SafetensorError) as err:
            raise CheckpointError(f"{path}: cannot read safetensors: {err}") from err
    if quantized:
        dequantize_state(state, quantization, dtype=dtype, where=str(files[0].parent))
    return state


def read_tensor_headers(folder: Path, *, prefix: str = "", strip_prefix: bool = False,
                        dtype: torch.dtype | None = None, quantization: Quantization | None = None,
                        reads: Callable[[str], bool] | None = None) -> dict:
    """`read_tensors` on the headers: `TensorHeader`s, cast and dequantised as the tensors would be."""
    state: dict = {}
    quantized = False
    for key, header in checkpoint_headers(folder).items():
        if key.startswith(prefix) and (reads is None or reads(key)):
            quantized |= _place(state, key, header, prefix if strip_prefix else "", dtype)
    if quantized:
        dequantize_state(state, quantization, dtype=dtype, where=str(folder))
    return state


def _place(state: dict, key: str, tensor, strip: str, dtype: torch.dtype | None) -> bool:
    """Put one read tensor in `state` in the run's dtype; True when it is a quantised part (left as
    stored until `dequantize_state`)."""
    stored = is_quantized_part(key, tensor)
    if dtype is not None and tensor.is_floating_point() and not stored:
        tensor = tensor.to(torch.float32 if keeps_float32(key) else dtype)
    state[key[len(strip):]] = tensor
    return stored


def tensor_names(folder: Path) -> list[str]:
    """Every tensor name in the checkpoint folder, from the checked file headers."""
    return list(checkpoint_headers(folder))
