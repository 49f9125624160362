"""The matrix products of our models' layers, and which kernel runs them.

Contract: `Linear` (an `nn.Linear`, same weights and keys), `project(x, weight, bias, out_dtype)`
(x @ weight^T + bias) and `project_heads(x, weights)` (one weight per head: MLA's up-projections)
compute what `F.linear` / `torch.einsum` compute. Inside `row_invariant_products()` and outside a
compiled graph, on CPU, they run the row-invariant kernel of kernels/cpu_linear.py instead: each
row's result is then the same bits whatever other rows share the product and however many threads
run it. The runner turns it on for its eager CPU steps (pipelines/compiled.py), where the rows are
the slots' verified tokens and drafts: a token verified beside k drafts must come out as plain
decoding computes it alone. A compiled step has Inductor's C++ template for that (pipelines/
cpu_gemm.py), and a prefill keeps the BLAS (its rows are one prompt's, pipelines/prefill.py): there
`project` is `F.linear`, as it is on CUDA and everywhere outside the switch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from specgen.kernels import cpu_linear

_row_invariant = False


@contextmanager
def row_invariant_products(on: bool = True) -> Iterator[None]:
    """CPU products in the block run row-invariantly (`on`), or through the BLAS as usual."""
    global _row_invariant
    before, _row_invariant = _row_invariant, on
    try:
        yield
    finally:
        _row_invariant = before


def _invariant(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # is_compiling first: a traced graph never reads the switch (nor guards on it)
    return not torch.compiler.is_compiling() and _row_invariant and cpu_linear.supports(x, weight)


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    # x: [..., K]; weight: [N, K]; bias: [N] | None -> [..., N] (out_dtype, default x's)
    if _invariant(x, weight):
        return cpu_linear.linear(x, weight, bias, out_dtype)
    out = F.linear(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)


def project_heads(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    # x: [..., H, K]; weights: [H, N, K] -> [..., H, N]
    if not torch.compiler.is_compiling() and _row_invariant and x.device.type == "cpu":
        if weights.stride(-1) != 1 or weights.stride(-2) != weights.shape[-1]:
            weights = weights.contiguous()     # the kernel reads each head's rows whole
        if cpu_linear.supports(x, weights):
            return cpu_linear.linear(x, weights)
    return torch.einsum("...hk,hnk->...hn", x, weights)


class Linear(nn.Linear):
    """`nn.Linear` whose product is `project`'s."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)
