"""Turning a module built on the meta device into a real one: checkpoint tensors, or random weights.

Contract: `build(make, state, dummy=..., dtype=..., device=...)` calls `make()` under the meta device
(no memory), then either assigns `state` (every tensor the module expects, nothing more, each shape
checked; floating tensors cast to `dtype`) or allocates the module directly in `dtype` on `device`
and fills it with deterministic random weights (load_format: dummy). Tensors shared under two names
(a tied LM head) stay one tensor. A module with non-persistent buffers recomputes them in its
`init_buffers(device)`, called last. Problems raise `CheckpointError` naming `where`; a state that
does not fit raises `LayoutError`, which lists every missing, unexpected and misshapen tensor.
Given `TensorHeader`s (a dry load: checkpoints/headers.py), `build` runs the same checks and returns
the module still on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specgen.errors import CheckpointError
from specgen.models.tensor_header import is_header_state

# Tensors that stay float32 in any run dtype (transformers keeps them so too): the MoE router's
# score-correction bias decides expert choices by small margins.
FLOAT32_TENSORS = ("e_score_correction_bias",)
# Block-FP8 weights kept as FP8 (kernels/block_fp8.py): the weights stay FP8, their scales float32.
FP8_SCALE_SUFFIX = "scale_inv"
# Packed INT4 routed experts kept packed (kernels/int4_experts.py): words int32, scales as published.
INT4_SCALES = (".experts.gate_up_proj_scale", ".experts.down_proj_scale")


def keeps_float32(name: str) -> bool:
    """Whether the tensor of this checkpoint / module name stays float32 whatever the run's dtype."""
    return name.endswith(FLOAT32_TENSORS) or name.endswith(FP8_SCALE_SUFFIX)


class LayoutError(CheckpointError):
    """Checkpoint tensors that do not fit the module its config describes; `problems` lists them all."""

    def __init__(self, where: str, problems: list[str]) -> None:
        self.problems = problems
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        super().__init__(f"{where}: weights do not match the model: {shown}")


def build(make: Callable[[], nn.Module], state: dict[str, torch.Tensor] | None, *, dtype: torch.dtype,
          device, seed: int = 0, where: str = "checkpoint") -> nn.Module:
    """`state` None = random weights (dummy)."""
    with torch.device("meta"):
        module = make()
    if is_header_state(state):
        check_layout(module, state, where)
        return module
    if state is None and torch.device(device).type == "meta":
        return module           # the structure alone (a dry load's dummy target)
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


def layout_problems(module: nn.Module, state: dict) -> list[str]:
    """Every way `state` fails to fit `module`: missing and unexpected names, shapes the config does
    not imply (naming the checkpoint tensors a fused or stacked one came from, when known)."""
    own = module.state_dict()
    problems = [f"missing {k}" for k in sorted(own.keys() - state.keys())]
    problems += [f"unexpected {k}" for k in sorted(state.keys() - own.keys())]
    for key, tensor in state.items():
        if key in own and tuple(tensor.shape) != tuple(own[key].shape):
            sources = getattr(tensor, "names", ())
            origin = f" (from {', '.join(sources[:3])}{' ...' if len(sources) > 3 else ''})" \
                if sources and sources != (key,) else ""
            problems.append(f"{key}{origin} has shape {list(tensor.shape)}, the config implies "
                            f"{list(own[key].shape)}")
    return problems


def check_layout(module: nn.Module, state: dict, where: str) -> None:
    problems = layout_problems(module, state)
    if problems:
        raise LayoutError(where, problems)


def load_into(module: nn.Module, state: dict[str, torch.Tensor], *, dtype: torch.dtype,
              device: torch.device | str, where: str) -> None:
    """Assign `state` to `module` (floating tensors cast to `dtype`), all on `device`."""
    check_layout(module, state, where)
    cast: dict[int, torch.Tensor] = {}  # by identity: a tensor under two names is cast once

    def placed(key: str, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in cast:
            target = torch.float32 if keeps_float32(key) else dtype
            # FP8 weights stay FP8; kept INT4 experts' scales stay as published
            keep = not t.is_floating_point() or t.dtype == torch.float8_e4m3fn or key.endswith(INT4_SCALES)
            cast[id(t)] = t.to(device) if keep else t.to(device=device, dtype=target)
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
