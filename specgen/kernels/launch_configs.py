"""The launch configuration of every Triton kernel specgen launches: one table, read by the launch code
and walked by tests/test_gpu_compile.py.

Contract. Each kernel's wrapper asks this module for its tiles, warps and stages (`attention(dtype,
head_dim)`, `latent_attention(dtype)`, ...) and launches with exactly that; nothing else picks a tile.
The compile test builds every entry for A100 (sm_80) and H100 (sm_90) with Triton's offline compiler
(kernels/offline_compile.py) and fails if one asks for more shared memory than the device gives a block
or spills registers (`MAX_STACK_BYTES`). A key with no entry is refused with a clear error, never
launched with a guess.

How the entries were chosen (Triton 3.9, ptxas 12.9 for sm_80 / 13.4 for sm_90, no GPU needed:
`python -m specgen.kernels.offline_compile` prints every entry's footprint): the larger tiles that
compile with no spill and at most MAX_REGISTERS on both architectures. Where a larger tile fits in
shared memory it often does not fit in registers: the generic kernel in float32 at head_dim 128 with
64 x 64 tiles asks for 115 KiB (2 stages) or 176 KiB (3, Triton's default: over an A100's 163 KiB) and
ptxas caps it at 32 registers a thread with an 8 KiB stack of spills; bf16 at head_dim 128 with 64 x 64
tiles spills 1.2 KiB at 4 warps and needs all 255 registers at 8. Zero spills is the bound: a spill is
a local-memory round trip inside the key loop, which is the kernel's whole cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Bytes of stack frame (spilled registers) a thread may use in any entry; see the docstring.
MAX_STACK_BYTES = 0
# Registers a thread may use: headroom under the hardware's 255, so that another ptxas (the GPU
# machine's Triton may ship an older one) allocating a little differently does not start spilling.
MAX_REGISTERS = 224


@dataclass(frozen=True)
class Launch:
    tiles: dict[str, int] = field(default_factory=dict)   # the kernel's tile constexprs, by name
    num_warps: int = 4
    num_stages: int = 2

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.tiles.items())), self.num_warps, self.num_stages))


# The generic attention kernel (kernels/attention.py), by (bytes per element, head_dim padded to a power
# of two). Wider heads than 256 have no entry: MLA's 576-wide latent entries take kernels/latent_attention.py.
ATTENTION: dict[tuple[int, int], Launch] = {
    (2, 64): Launch({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8),
    (2, 128): Launch({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=8),
    (2, 256): Launch({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=8),
    (4, 64): Launch({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4),
    (4, 128): Launch({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=8),
    (4, 256): Launch({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=8),
}

# MLA's latent kernel (kernels/latent_attention.py) at kv_lora_rank 512 + rope 64, by bytes per element.
LATENT_ATTENTION: dict[int, Launch] = {
    2: Launch({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=8),
    4: Launch({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=8),
}
LATENT_WIDTHS = (512, 64)      # the widest entries checked (DeepSeek-V3, Kimi K2.5)

# The split-K merge (kernels/attention.py), one program per (row, query, head), by padded head_dim.
MERGE = Launch({}, num_warps=4, num_stages=1)

# Rejection (kernels/rejection.py): one program per row, BLOCK_V vocabulary entries per iteration.
VERIFY = Launch({"BLOCK_V": 1024}, num_warps=4, num_stages=1)

# Block-FP8 products (kernels/block_fp8.py; compute capability 8.9+, so checked on sm_90 only).
BLOCK_FP8_GEMM = Launch({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=8, num_stages=2)
BLOCK_FP8_PAIRS = Launch({"BLOCK_N": 32}, num_warps=8, num_stages=2)
BLOCK_FP8_GROUPED = Launch({"BLOCK_M": 32, "BLOCK_N": 64, "DOT_K": 64}, num_warps=8, num_stages=2)

# Packed-INT4 routed experts (kernels/int4_experts.py; bf16 tensor cores, so sm_80 and sm_90): one
# kernel at every batch size, BLOCK_M pairs of one expert a program (16: the smallest tl.dot takes,
# since a decode step's blocks mostly hold one pair).
INT4_GROUPED = Launch({"BLOCK_M": 16, "BLOCK_N": 64}, num_warps=4, num_stages=2)


def padded_head_dim(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def attention(dtype: torch.dtype, head_dim: int) -> Launch:
    """The generic attention kernel's launch for q / cache `dtype` and `head_dim`."""
    key = (torch.empty((), dtype=dtype).element_size(), max(64, padded_head_dim(head_dim)))
    if key not in ATTENTION:
        raise ValueError(f"no attention kernel configuration for {dtype} at head_dim {head_dim} "
                         f"(the kernel takes head dims up to 256; MLA's latent cache has a kernel of its own)")
    return ATTENTION[key]


def latent_attention(dtype: torch.dtype, latent: int, rope: int) -> Launch:
    """MLA's latent kernel's launch; wider entries than those checked are refused (narrower ones take
    less shared memory and fewer registers with the same tiles)."""
    size = torch.empty((), dtype=dtype).element_size()
    if size not in LATENT_ATTENTION or padded_head_dim(latent) > LATENT_WIDTHS[0] or padded_head_dim(rope) > LATENT_WIDTHS[1]:
        raise ValueError(f"no latent attention kernel configuration for {dtype} at {latent} + {rope} "
                         f"(checked up to {LATENT_WIDTHS[0]} + {LATENT_WIDTHS[1]} in bf16, fp16 and float32)")
    return LATENT_ATTENTION[size]
