"""Turning a module built on the meta device into a real one: checkpoint tensors, or random weights.

Contract: `build(make, state, dummy=..., dtype=..., device=...)` calls `make()` under the meta device
(no memory), then either assigns `state` (every tensor the module expects, nothing more, each shape
checked; floating tensors cast to `dtype`) or allocates the module directly in `dtype` on `device`
and fills it with deterministic random weights (load_format: dummy). Tensors shared under two names
(a tied LM head) stay one tensor. A module with non-persistent buffers recomputes them in its
`init_buffers(device)`, called last. Problems raise `CheckpointError` naming `where`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specgen.checkpoints.store import CheckpointError
from specgen.checkpoints.weights import keeps_float32


def build(make: Callable[[], nn.Module], state: dict[str, torch.Tensor] | None, *, dtype: torch.dtype,
          device, seed: int = 0, where: str = "checkpoint") -> nn.Module:
    """`state` None = random weights (dummy)."""
    with torch.device("meta"):
        module = make()
    if state is None:
        # Allocated straight in the run's dtype on the device: never an fp32 copy of an 8B model.
        # Moving off the meta device gives every module its own new Parameter, so parameters shared
        # under two names (a tied LM head) are tied again afterwards.
        shared = _shared_parameter_names(module)
        module = module.to(dtype)
        for name, param in module.named_parameters():
            if keeps_float32(name):
                param.data = param.data.float()
        module = module.to_empty(device=device)
        for first, others in shared:
            for name in others:
                _set_parameter(module, name, module.get_parameter(first))
        random_init(module, seed=seed)
    else:
        load_into(module, state, dtype=dtype, device=device, where=where)
    # Non-persistent buffers (RoPE frequencies, id maps) are computed, never loaded or cast.
    init_buffers = getattr(module, "init_buffers", None)
    if init_buffers is not None:
        init_buffers(device)
    return module


def _shared_parameter_names(module: nn.Module) -> list[tuple[str, list[str]]]:
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [(group[0], group[1:]) for group in names.values() if len(group) > 1]


def _set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, attr, param)


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
    cast: dict[int, torch.Tensor] = {}  # by identity: a tensor under two names is cast once

    def placed(key: str, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in cast:
            target = torch.float32 if keeps_float32(key) else dtype
            cast[id(t)] = t.to(device=device, dtype=target) if t.is_floating_point() else t.to(device)
        return cast[id(t)]

    module.load_state_dict({k: placed(k, v) for k, v in state.items()}, assign=True, strict=True)


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
