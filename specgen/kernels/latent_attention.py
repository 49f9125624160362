"""MLA's absorbed attention over a latent cache: Triton kernel, wrapper, reference.

Contract. Inputs, for B rows of T new queries of H heads each (their own entries already cached):
  q          [B, T, H, R + P]      absorbed queries: the latent part (q_nope . W_UK, R = kv_lora_rank
                                   wide), then the rotated rope part (P = qk_rope_head_dim wide);
                                   any strides with a contiguous last dim
  cache      [S, 1, L, R + P]      the layer's latent cache: per position the normed latent, then the
                                   rotated shared rope key (models/mla.py's LatentCache)
  rows       [B] int64             cache slot of each row
  positions  [B, T] int64          absolute position of each query, non-decreasing along T
Output [B, T, H, R] (q's dtype): query (b, t, h) attends causally to the entries of slot rows[b] at
positions 0 .. positions[b, t]: softmax((q . entry) * scale) weighted LATENTS (the first R values of
each entry; W_UV is applied by the caller). That is `attention.attention_reference` with keys = values
= the entries, cut to R, which is also `latent_attention_reference`, the CPU path and the test oracle.

Why a kernel of its own (GPU_NOTES 1). Through the generic kernel an MLA entry is a 576-wide head
padded to 1024, with separate K and V tiles of the same memory: at DeepSeek-V3's widths that asks for
more shared memory than an H100 has (227 KiB). Here each block of entries is loaded once, as a latent
tile (R wide) and a rope tile (P wide), and serves both products: scores = q_lat . latent + q_rope .
rope, values = the latent tile. The accumulator is R wide, not 1024. Tile rows are (t, head) pairs,
so one program serves a block of heads of one row, reading the row's entries once for all of them;
long rows are split over programs and merged by log-sum-exp, as in kernels/attention.py.
"""

from __future__ import annotations

import torch

from . import attention as generic
from . import keyed_noise as kn
from . import launch_configs
from .keyed_noise import tl, triton

def latent_attention_reference(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                               positions: torch.Tensor, scale: float, latent_dim: int) -> torch.Tensor:
    # q: [B, T, H, R + P]; cache: [S, 1, L, R + P]; rows: [B]; positions: [B, T] -> [B, T, H, R]
    mask = generic.causal_mask(positions, torch.arange(cache.shape[2], device=q.device))
    out = generic.attention_reference(q, cache, cache, rows, mask, scale)
    return out[..., :latent_dim]


# ---------------------------------------------------------------------------------------------------
# Triton kernel (a plain function, jitted on first use: see keyed_noise's docstring for why)
# ---------------------------------------------------------------------------------------------------


def _latent_attention_kernel(
    q_ptr, c_ptr, rows_ptr, pos_ptr, o_ptr, lse_ptr,
    sq_b, sq_t, sq_h,            # q strides (the last one is 1)
    sc_s, sc_l,                  # cache strides: slot, position (the last one is 1)
    so_b, so_t, so_h, so_s,      # partial outputs [B, T, H, splits, R] (contiguous)
    T, R, P, scale, chunk,       # chunk: entries per split (kernels/attention.py: `split_chunk`)
    HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    IEEE: tl.constexpr,          # fp32 inputs: exact products (no tf32)
):
    # program (b, query tile, split); tile rows are (t, head) pairs: m = t * HEADS + head
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offs_m // HEADS
    head = offs_m % HEADS
    valid_m = t < T
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    valid_r = offs_r < R
    valid_p = offs_p < P
    q_rows = q_ptr + b * sq_b + t[:, None] * sq_t + head[:, None] * sq_h
    q_lat = tl.load(q_rows + offs_r[None, :], mask=valid_m[:, None] & valid_r[None, :], other=0.0)
    q_rope = tl.load(q_rows + R + offs_p[None, :], mask=valid_m[:, None] & valid_p[None, :], other=0.0)
    pos = tl.load(pos_ptr + b * T + t, mask=valid_m, other=-1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    start, end = generic._split_range_dev(pos, split, chunk)
    base = c_ptr + row * sc_s
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid_n = offs_n < end
        entries = base + offs_n[:, None] * sc_l
        latent = tl.load(entries + offs_r[None, :], mask=valid_n[:, None] & valid_r[None, :], other=0.0)
        rope = tl.load(entries + R + offs_p[None, :], mask=valid_n[:, None] & valid_p[None, :], other=0.0)
        if IEEE:
            s = (tl.dot(q_lat, tl.trans(latent), input_precision="ieee")
                 + tl.dot(q_rope, tl.trans(rope), input_precision="ieee")) * scale
        else:
            s = (tl.dot(q_lat, tl.trans(latent)) + tl.dot(q_rope, tl.trans(rope))) * scale
        s = tl.where((offs_n[None, :] <= pos[:, None]) & valid_n[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = generic._online_softmax_dev(s, m_i, l_i)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent)
    out, lse = generic._finish_dev(acc, m_i, l_i)
    o_offs = b * so_b + t[:, None] * so_t + head[:, None] * so_h + split * so_s + offs_r[None, :]
    tl.store(o_ptr + o_offs, out, mask=valid_m[:, None] & valid_r[None, :])
    # lse: [B, T, H, splits], contiguous
    tl.store(lse_ptr + ((b * T + t) * HEADS + head) * tl.num_programs(2) + split, lse, mask=valid_m)


_jitted = False


def jit_kernels() -> None:
    global _jitted, _latent_attention_kernel
    if _jitted:
        return
    if triton is None:
        raise RuntimeError("triton is not installed")
    generic.jit_kernels()          # the online-softmax device functions this kernel calls
    _latent_attention_kernel = triton.jit(_latent_attention_kernel)
    _jitted = True


if kn.should_jit_at_import():
    jit_kernels()


def latent_attention_triton(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                            positions: torch.Tensor, scale: float, latent_dim: int, splits: int = 1) -> torch.Tensor:
    """Guarded launch of `_latent_attention_kernel` (+ the log-sum-exp merge of the splits), tiles from
    kernels/launch_configs.py."""
    # q: [B, T, H, R + P]; cache: [S, 1, L, R + P]; rows: [B]; positions: [B, T] -> [B, T, H, R]
    if not _jitted:
        jit_kernels()
    B, T, H, D = q.shape
    R, P = latent_dim, D - latent_dim
    assert cache.dim() == 4 and cache.shape[1] == 1 and cache.shape[3] == D, \
        "the latent cache must be [S, 1, L, R + P] like q's last dim"
    assert 0 < R < D, "latent_dim must leave a rope part"
    assert q.stride(-1) == 1 and cache.stride(-1) == 1, "the entry dimension must be contiguous"
    assert cache.dtype == q.dtype, "q and the cache must share a dtype"
    assert rows.shape == (B,) and positions.shape == (B, T), "rows: [B], positions: [B, T]"
    assert rows.dtype == torch.int64 and positions.dtype == torch.int64
    assert positions.is_contiguous() and rows.is_contiguous()
    assert all(t.device == q.device for t in (cache, rows, positions))
    part = torch.empty(B, T, H, splits, R, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, H, splits, dtype=torch.float32, device=q.device)
    if B * T == 0:
        return q.new_empty(B, T, H, R)
    launch = launch_configs.latent_attention(q.dtype, R, P)
    tiles = -(-T * H // launch.tiles["BLOCK_M"])
    _latent_attention_kernel[(B, tiles, splits)](
        q, cache, rows, positions, part, lse,
        q.stride(0), q.stride(1), q.stride(2),
        cache.stride(0), cache.stride(2),
        part.stride(0), part.stride(1), part.stride(2), part.stride(3),
        T, R, P, float(scale), generic.split_chunk(cache.shape[2], splits),
        HEADS=H, BLOCK_R=launch_configs.padded_head_dim(R), BLOCK_P=launch_configs.padded_head_dim(P),
        IEEE=q.dtype == torch.float32, **launch.tiles, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return generic.merge_splits_triton(part, lse, q.dtype)


@torch.library.custom_op("specgen::latent_attention", mutates_args=())
def latent_attention(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                     scale: float, latent_dim: int, splits: int) -> torch.Tensor:
    return latent_attention_triton(q, cache, rows, positions, scale, latent_dim, splits)


@latent_attention.register_fake
def _(q, cache, rows, positions, scale, latent_dim, splits):
    return q.new_empty(*q.shape[:3], latent_dim)
