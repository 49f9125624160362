"""Reading tensors: safetensors (single file or sharded), cast to the runtime dtype, into a module.

Contract: `read_tensors(files)` returns every tensor of the files keyed by name; `load_into(module,
state)` assigns them to a module built on the meta device, failing with the missing / unexpected
names rather than leaving random weights behind.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from specgen.checkpoints.store import CheckpointError


def read_tensors(files: list[Path], *, prefix: str = "", strip_prefix: bool = False) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if key.startswith(prefix):
                        state[key[len(prefix):] if strip_prefix else key] = f.get_tensor(key)
        except (OSError, RuntimeError, ValueError) as err:
            raise CheckpointError(f"{path}: cannot read safetensors: {err}") from err
    return state


def load_into(module: nn.Module, state: dict[str, torch.Tensor], *, dtype: torch.dtype,
              device: torch.device | str, where: str) -> None:
    """Assign `state` to `module` (floating tensors cast to `dtype`), all on `device`."""
    expected = set(module.state_dict().keys())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:6])}{' ...' if len(unexpected) > 6 else ''}")
        raise CheckpointError(f"{where}: weights do not match the model: {'; '.join(parts)}")
    own = module.state_dict()
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise CheckpointError(f"{where}: {key} has shape {list(tensor.shape)}, "
                                  f"the config implies {list(own[key].shape)}")
    cast = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device))
            for k, v in state.items()}
    module.load_state_dict(cast, assign=True, strict=True)


def random_init(module: nn.Module, *, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights (load_format: dummy): normal(0, std) matrices, unit norms."""
    with torch.no_grad():
        for index, (name, param) in enumerate(module.named_parameters()):
            if param.ndim == 1:
                param.fill_(1.0 if "norm" in name else 0.0)
                continue
            # One generator per tensor, on the tensor's device: reproducible, and fast for 8B shapes.
            gen = torch.Generator(device=param.device).manual_seed(seed * 100_003 + index)
            param.normal_(0.0, std, generator=gen)
