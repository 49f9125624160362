"""A tensor known by its header alone: what a dry load hands the model and draft builders.

Contract: `TensorHeader` stands in for a tensor (shape, dtype, the checkpoint names it came from) in
the loaders' key conversions and the builders (checkpoints/loading.py and headers.py, `dry=True`;
drafts/, models/materialise.py): `torch.cat`, `torch.stack`, `split`, `chunk` and casts give headers
of the right shape, or `ShapeMismatch` naming the tensors, so the layout a real load would build is
checked without a byte of tensor data. `is_header_state(state)` tells a dry load's state from a real
one. Defined with the models, which accept it, so that they never import the loaders.
"""

from __future__ import annotations

import math

import torch


class ShapeMismatch(ValueError):
    """Checkpoint tensors whose shapes cannot be fused or stacked (the loader names the folder)."""


class TensorHeader:
    """A tensor's shape and dtype, with no data (see the module docstring)."""

    __slots__ = ("shape", "dtype", "names")

    def __init__(self, shape, dtype: torch.dtype, names: tuple[str, ...] = ()) -> None:
        self.shape = tuple(shape)       # a plain tuple: torch.Size costs more, and compares equal
        self.dtype = dtype
        self.names = names      # the checkpoint tensors it stands for (several once fused / stacked)

    def __repr__(self) -> str:
        return f"TensorHeader({list(self.shape)}, {str(self.dtype).removeprefix('torch.')})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def _like(self, shape, dtype: torch.dtype | None = None, names: tuple[str, ...] | None = None) -> TensorHeader:
        return TensorHeader(shape, dtype or self.dtype, self.names if names is None else names)

    def to(self, *args, **kwargs) -> TensorHeader:
        dtype = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
        return self._like(self.shape, dtype)

    def float(self) -> TensorHeader:
        return self._like(self.shape, torch.float32)

    def contiguous(self) -> TensorHeader:
        return self

    def split(self, sizes, dim: int = 0) -> tuple[TensorHeader, ...]:
        """As `Tensor.split`: an int is a chunk size (the last chunk smaller), a list the sizes."""
        length = self.shape[dim]
        if isinstance(sizes, int):
            sizes = [sizes] * (length // sizes) + ([length % sizes] if length % sizes else [])
        if sum(sizes) != length:
            raise ShapeMismatch(f"{self._named()} has {length} rows along dim {dim}, not {sum(sizes)}")
        return tuple(self._like(_with(self.shape, dim, s)) for s in sizes)

    def chunk(self, n: int, dim: int = 0) -> tuple[TensorHeader, ...]:
        return self.split(math.ceil(self.shape[dim] / n), dim)

    def _named(self) -> str:
        return ", ".join(self.names[:3]) + (" ..." if len(self.names) > 3 else "") or "a tensor"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in (torch.cat, torch.stack):
            raise TypeError(f"{func.__name__} is not defined on tensor headers (a checkpoint check needs shapes only)")
        parts = list(args[0])
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        first = parts[0]
        names = tuple(n for p in parts for n in p.names)
        # stack: every shape equal; cat: equal but along `dim` (torch raises RuntimeError for either)
        rest = [p.shape if func is torch.stack else _with(p.shape, dim, 0) for p in parts]
        odd = next((p for p, r in zip(parts, rest) if r != rest[0]), None)
        if odd is not None:
            verb = "stacked" if func is torch.stack else "concatenated"
            raise ShapeMismatch(f"{odd._named()} has shape {list(odd.shape)}, which cannot be {verb} with "
                                f"{first._named()} of shape {list(first.shape)}")
        if func is torch.stack:
            at = dim if dim >= 0 else dim + first.ndim + 1
            return first._like((*first.shape[:at], len(parts), *first.shape[at:]), names=names)
        return first._like(_with(first.shape, dim, sum(p.shape[dim] for p in parts)), names=names)


def _with(shape: tuple, dim: int, size: int) -> tuple:
    s = list(shape)
    s[dim] = size
    return tuple(s)


def is_header_state(state: dict | None) -> bool:
    """Whether a loader's state holds headers (a dry load) rather than tensors."""
    return bool(state) and isinstance(next(iter(state.values())), TensorHeader)
