"""Counter-based noise keyed by (request key, position, token id, stream).

Contract: every random number specgen uses is a pure function of its coordinates, never of call order,
batch slot or draft length. That is what makes a seeded speculative run emit exactly the tokens of a
seeded plain run, at any batch size.

Definition (all arithmetic on unsigned 32-bit integers, wrapping):

    mix32(x)           lowbias32: x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
    row(key, t, s)     = mix32(mix32(key ^ STREAM_SALT[s]) + t)             per (request, position): [B, T]
    bits(key, t, v, s) = mix32(mix32(row(key, t, s) ^ v) + 0x9E3779B9)       per vocabulary entry: [B, T, V]
    u(key, t, v, s)    = ((bits >> 9) + 0.5) * 2**-23                         in (0, 1)
    g(key, t, v, s)    = -log(-log(u))                                        Gumbel(0, 1)
    noise_key_for(seed, request_key): h = 0x6A09E667, then h = mix32(h + w) for the 32-bit words
                       w = seed lo, seed hi, request_key lo, request_key hi (both taken mod 2**64)

`t` is the absolute sequence position (taken mod 2**32), `key` the per-request noise key from
`noise_key_for`, `s` one of the streams below. `u` keeps 23 random bits and sits at the centre of its
cell: (2j + 1) * 2**-24 needs 24 significant bits, so it is exact in float32, never 0 or 1, and
symmetric (u and 1 - u are both on the grid). A full 24-bit draw with a half-cell offset would need 25
significand bits and would round to 1.0 at the top.

The same definition exists twice: in PyTorch (int64 tensors masked to 32 bits; the reference used on
CPU) and as Triton device functions (tl.uint32; used inside kernels). The integers are bit-identical;
the test suite checks it.

Triton is optional. Its device functions are written as plain functions and turned into `triton.jit`
functions by `jit_device_functions()`: `triton.jit` decides between compiler and CPU interpreter
(TRITON_INTERPRET=1) when it decorates, so decorating is done at import only when CUDA or the
interpreter is already selected, and otherwise on first use.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the PyTorch reference is complete on its own
    triton = None
    tl = None

# Streams: independent noise for each random decision at one position.
TARGET = 0  # sampling the target: plain decoding, one-hot verification, bonus token
DRAFT = 1  # stochastic draft sampling
ACCEPT = 2  # the uniform of the accept test u * q(x) < p(x)
RESIDUAL = 3  # sampling normalise(max(p - q, 0)) after a rejection

# First hex digits of pi, one per stream.
STREAM_SALT = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344)
GOLDEN = 0x9E3779B9
_M32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B
_U_SCALE = 2.0**-23


# ---------------------------------------------------------------------------------------------------
# Pure Python (host): key derivation
# ---------------------------------------------------------------------------------------------------


def mix32_int(x: int) -> int:
    """lowbias32 on a Python int (taken mod 2**32)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL1) & _M32
    x ^= x >> 15
    x = (x * _MUL2) & _M32
    x ^= x >> 16
    return x


def noise_key_for(seed: int, request_key: int) -> int:
    """Per-request noise key in [0, 2**32) from the recipe seed and a request id (both mod 2**64)."""
    h = 0x6A09E667
    for word in (seed, seed >> 32, request_key, request_key >> 32):
        h = mix32_int(h + (word & _M32))
    return h


# ---------------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # x in [0, 2**32). The full product x * c can pass 2**63 and overflow int64 (undefined in C++, so
    # not something to lean on under inductor); split c into 16-bit halves so every partial product
    # stays below 2**48. Result: (x * c) mod 2**32, i.e. the uint32 product.
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2**32); shifts are logical since x >= 0."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MUL2)
    return x ^ (x >> 16)


def row_hash(noise_key: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Per-row part of the hash. noise_key [B] int64, positions [B, T] int64 -> [B, T] int64."""
    # noise_key: [B]; positions: [B, T]
    k = mix32((noise_key.long() & _M32) ^ STREAM_SALT[stream])
    return mix32((k[:, None] + (positions.long() & _M32)) & _M32)


def noise_bits(
    noise_key: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, stream: int
) -> torch.Tensor:
    """32 random bits per (row, token). token_ids [V'] int64 -> [B, T, V'] int64 in [0, 2**32)."""
    # noise_key: [B]; positions: [B, T]; token_ids: [V']
    row = row_hash(noise_key, positions, stream)
    h = mix32(row[:, :, None] ^ token_ids.long())
    return mix32((h + GOLDEN) & _M32)


def bits_to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """Top 23 bits -> cell centre in (0, 1), exact in float32."""
    return ((bits >> 9).to(torch.float32) + 0.5) * _U_SCALE


def uniform(
    noise_key: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, stream: int
) -> torch.Tensor:
    """u(key, t, v, s) in (0, 1) as float32: [B, T, V']."""
    return bits_to_uniform(noise_bits(noise_key, positions, token_ids, stream))


def gumbel(
    noise_key: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor, stream: int
) -> torch.Tensor:
    """g = -log(-log(u)) as float32: [B, T, V']. argmax(logprobs + g) samples softmax(logprobs)."""
    u = uniform(noise_key, positions, token_ids, stream)
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------------------------------------------
# Triton device functions (same integers as above). Kernels elsewhere call them as `kn._gumbel_dev`.
# ---------------------------------------------------------------------------------------------------


def _mix32_dev(x):
    # x: uint32; uint32 arithmetic wraps and `>>` is logical, exactly as in `mix32`
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def _row_hash_dev(key, position, salt):
    # key, position: uint32 scalars; salt: constexpr, STREAM_SALT[stream]
    return _mix32_dev(_mix32_dev(key ^ salt) + position)


def _bits_dev(row, v):
    # row: uint32 scalar; v: uint32 [BLOCK] (or scalar)
    return _mix32_dev(_mix32_dev(row ^ v) + 0x9E3779B9)


def _uniform_dev(row, v):
    return ((_bits_dev(row, v) >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23


def _gumbel_dev(row, v):
    return -tl.log(-tl.log(_uniform_dev(row, v)))


def _noise_kernel(key_ptr, pos_ptr, bits_ptr, u_ptr, T, V, SALT: tl.constexpr, BLOCK_V: tl.constexpr):
    # one program per (b, t) row: bits [B, T, V] int64, u [B, T, V] f32. The annotations are strings
    # (`from __future__ import annotations`): triton only looks for "constexpr" in them.
    r = tl.program_id(0).to(tl.int64)
    key = tl.load(key_ptr + r // T).to(tl.uint32)
    pos = tl.load(pos_ptr + r).to(tl.uint32)
    row = _row_hash_dev(key, pos, SALT)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        bits = _bits_dev(row, offs.to(tl.uint32))
        tl.store(bits_ptr + r * V + offs, bits.to(tl.int64), mask=mask)
        tl.store(u_ptr + r * V + offs, _uniform_dev(row, offs.to(tl.uint32)), mask=mask)


_DEVICE_FUNCTIONS = ("_mix32_dev", "_row_hash_dev", "_bits_dev", "_uniform_dev", "_gumbel_dev", "_noise_kernel")
_jitted = False


def triton_available() -> bool:
    return triton is not None


def jit_device_functions() -> None:
    """Replace the plain device functions above by their `triton.jit` versions (idempotent)."""
    global _jitted
    if _jitted:
        return
    if triton is None:
        raise RuntimeError("triton is not installed")
    g = globals()
    for name in _DEVICE_FUNCTIONS:
        g[name] = triton.jit(g[name])
    _jitted = True


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def should_jit_at_import() -> bool:
    """True when decorating now picks the right backend: CUDA present or the interpreter requested."""
    return triton is not None and (interpreting() or torch.cuda.is_available())


if should_jit_at_import():
    jit_device_functions()


def noise_bits_triton(
    noise_key: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: int, block_v: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton side of the definition, for tests: (bits [B, T, V] int64, u [B, T, V] f32)."""
    # noise_key: [B] int64; positions: [B, T] int64
    jit_device_functions()
    assert noise_key.dtype == torch.int64 and positions.dtype == torch.int64
    assert noise_key.is_contiguous() and positions.is_contiguous()
    B, T = positions.shape
    assert noise_key.shape == (B,) and noise_key.device == positions.device
    bits = torch.empty(B, T, vocab_size, dtype=torch.int64, device=positions.device)
    u = torch.empty(B, T, vocab_size, dtype=torch.float32, device=positions.device)
    if B * T > 0:
        _noise_kernel[(B * T,)](
            noise_key, positions, bits, u, T, vocab_size, SALT=STREAM_SALT[stream], BLOCK_V=block_v
        )
    return bits, u
