"""Attention of new queries over a static KV cache with per-row lengths: Triton kernel, wrapper, reference.

Contract. Inputs, for B rows of T new queries each (their own K/V already written to the cache):
  q          [B, T, Hq, D]         any strides with a contiguous last dim
  k_cache    [S, Hkv, L, D]        the layer's cache (S slots, L positions); v_cache alike
  rows       [B] int64             cache slot of each row
  positions  [B, T] int64          absolute position of each query, non-decreasing along T
Output [B, T, Hq, D] (q's dtype): query (b, t, h) attends, causally, to the keys of slot rows[b] at
positions 0 .. positions[b, t] of KV head h // (Hq / Hkv), softmax(q.k * scale) weighted values.

Why a kernel (GPU_NOTES 3): SDPA with a boolean mask and GQA falls back to the math kernel on CUDA,
repeats K/V per query head, and makes every row pay for the longest row's bucket. This kernel reads
each KV head once for all the query heads of its group (GQA packed into the tile's rows with the T
queries), stops at each row's own length, and splits long rows over several programs (split-K, as
flash-decoding does) whose partial results are merged by their log-sum-exp.

`attention_reference` is the same contract in PyTorch (SDPA over the first `kv_len` cache positions
with a causal mask), the CPU path and the test oracle. With `row_invariant` (the decode step) it is
written out in float32 instead of SDPA: each query row's output is then the same bits whatever other
rows share the call. SDPA's CPU kernel is not: a query verified beside K drafts came out of it
differently than the same query alone (bf16: up to 5e-4, and 12 of the 24 demo prompts then
decoded other greedy tokens than plain decoding; fp32 differs in the last bits), which breaks
"speculative output == plain output" for reasons that have nothing to do with the drafts.
`cached_attention` is the kernel registered as the opaque custom op `specgen::cached_attention`, so
torch.compile and CUDA graphs call it as one extern node (Inductor never re-emits its source).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import keyed_noise as kn
from . import launch_configs
from .keyed_noise import tl, triton

# ---------------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------------


def causal_mask(positions: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
    # positions: [B, T]; key_index: [kv_len] (arange) -> [B, 1, T, kv_len] bool, key <= query position
    return key_index.view(1, 1, 1, -1) <= positions.view(positions.shape[0], 1, -1, 1)


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        rows: torch.Tensor | None, mask: torch.Tensor,
                        scale: float | None = None, row_invariant: bool = False) -> torch.Tensor:
    """SDPA over the first kv_len positions of the cache (kv_len = mask.shape[-1]).

    GQA is packed like the kernel does it: the G query heads of a KV head become G * T query rows
    of that head, so each key and value is read once, not once per query head (on CPU, where this
    path runs, decode attention is bound by reading the cache)."""
    # q: [B, T, Hq, D]; caches: [S, Hkv, L, D]; rows: [B] | None (= slots 0..B-1); mask: [B, 1, T, kv]
    B, T, Hq, D = q.shape
    kv_heads, kv_len = k_cache.shape[1], mask.shape[-1]
    group = Hq // kv_heads
    keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
    if rows is not None:
        keys, values = keys[rows], values[rows]
    # Always a copy (clone, then view): `reshape` copies or not depending on whether T is 1, which
    # would make the compiled step specialise on T (it serves every T: pipelines/compiled.py).
    packed = (q.view(B, T, kv_heads, group, D).permute(0, 2, 1, 3, 4)
              .clone(memory_format=torch.contiguous_format).view(B, kv_heads, T * group, D))
    mask = mask.repeat_interleave(group, dim=2)
    if row_invariant:
        out = _rowwise_attention(packed, keys, values, mask, scale if scale is not None else D ** -0.5,
                                 group).to(q.dtype)
    else:
        out = F.scaled_dot_product_attention(packed, keys.to(q.dtype), values.to(q.dtype), scale=scale,
                                             attn_mask=mask)
    return (out.view(B, kv_heads, T, group, D).permute(0, 2, 1, 3, 4)
            .clone(memory_format=torch.contiguous_format).view(B, T, Hq, D))


def _rowwise_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                       scale: float, group: int) -> torch.Tensor:
    # q: [B, H, T*G, D]; keys, values: [B, H, L, Dv]; mask: [B, 1 | H, T*G, L] -> [B, H, T*G, Dv] float32
    # Float32 throughout, as SDPA keeps its scores. A matmul's rows are NOT independent of how many
    # there are (BLAS picks its kernel, and so the order of the sums, by shape: fp32 scores of one
    # query differed in the last bit beside 1, 2 or 4 more), nor of the number of keys (a compiled
    # GEMM blocks its sum by a size hint: the plain job's graph and the speculative one's were
    # compiled at other key counts), so:
    # - compiled, both products are written as sums that Inductor emits as plain reduction loops
    #   (scores: over D, innermost; values: over the keys, in order), the same whatever T or L is;
    # - eager, each query position is its own matmul of G rows (the same shape whatever T is).
    B, H, M, D = q.shape
    t, L = M // group, keys.shape[-2]
    q, keys, values = q.float().view(B, H, t, group, D), keys.float(), values.float()
    if torch.compiler.is_compiling():
        scores = (q.unsqueeze(-2) * keys.view(B, H, 1, 1, L, D)).sum(-1)                     # [B, H, t, G, L]
    else:
        scores = torch.stack([q[:, :, i] @ keys.transpose(-1, -2) for i in range(t)], dim=2)
    probs = (scores * scale).masked_fill(~mask.view(B, -1, t, group, L), float("-inf")).softmax(dim=-1)
    if torch.compiler.is_compiling():
        out = (probs.unsqueeze(-1) * values.view(B, H, 1, 1, L, -1)).sum(-2)                 # [B, H, t, G, Dv]
    else:
        out = torch.stack([probs[:, :, i] @ values for i in range(t)], dim=2)
    return out.view(B, H, M, -1)


# ---------------------------------------------------------------------------------------------------
# Triton kernel (a plain function, jitted on first use: see keyed_noise's docstring for why)
# ---------------------------------------------------------------------------------------------------


def _online_softmax_dev(s, m_i, l_i):
    # one block of scores [M, N] into the running max and sum of each row: (p, alpha, m, l), where
    # the accumulator is rescaled by alpha before p's products are added
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # a row that has seen no visible key yet keeps m = -inf; shift by 0 there to avoid inf - inf
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - shift)
    p = tl.exp(s - shift[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


def _split_range_dev(pos, split, chunk):
    # Split s covers keys [s * chunk, (s + 1) * chunk): fixed chunks (a multiple of BLOCK_N) that depend on
    # the cache alone, so a row's sums run in an order set by its own length, whatever T, the batch or
    # the step (GPU_NOTES 2). A tile stops at its last query's position (pos: -1 for padding); a split
    # past it runs no iteration and leaves lse = -inf, which the merge weighs by exactly 0.
    start = split * chunk
    return start, tl.minimum(start + chunk, tl.max(pos, axis=0) + 1)


def _finish_dev(acc, m_i, l_i):
    # -> (the normalised output [M, D], the log-sum-exp [M]; -inf for a row that saw no key)
    seen = l_i > 0
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    return acc / tl.where(seen, l_i, 1.0)[:, None], lse


def _attention_kernel(
    q_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr, o_ptr, lse_ptr,
    sq_b, sq_t, sq_h,            # q strides (the last one is 1)
    sk_s, sk_h, sk_l,            # k and v cache strides (shared; the last one is 1)
    so_b, so_t, so_h, so_s,      # partial outputs [B, T, Hq, splits, D] (contiguous)
    T, D, scale, chunk,          # chunk: keys per split (a multiple of BLOCK_N)
    GROUP: tl.constexpr,         # query heads per KV head
    KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,          # fp32 inputs: exact products (no tf32)
):
    # program (b * KV_HEADS + kv head, query tile, split); tile rows are (t, g) pairs: m = t * GROUP + g
    pid = tl.program_id(0)
    b = (pid // KV_HEADS).to(tl.int64)
    kvh = pid % KV_HEADS
    split = tl.program_id(2)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    valid_m = t < T
    offs_d = tl.arange(0, BLOCK_D)
    valid_d = offs_d < D
    q = tl.load(q_ptr + b * sq_b + t[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
                mask=valid_m[:, None] & valid_d[None, :], other=0.0)
    pos = tl.load(pos_ptr + b * T + t, mask=valid_m, other=-1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    start, end = _split_range_dev(pos, split, chunk)
    k_base = k_ptr + row * sk_s + kvh * sk_h
    v_base = v_ptr + row * sk_s + kvh * sk_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid_n = offs_n < end
        kv_mask = valid_n[:, None] & valid_d[None, :]
        k = tl.load(k_base + offs_n[:, None] * sk_l + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where((offs_n[None, :] <= pos[:, None]) & valid_n[None, :], s, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax_dev(s, m_i, l_i)
        v = tl.load(v_base + offs_n[:, None] * sk_l + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    out, lse = _finish_dev(acc, m_i, l_i)
    o_offs = b * so_b + t[:, None] * so_t + head[:, None] * so_h + split * so_s + offs_d[None, :]
    tl.store(o_ptr + o_offs, out, mask=valid_m[:, None] & valid_d[None, :])
    # lse: [B, T, Hq, splits], contiguous
    tl.store(lse_ptr + ((b * T + t) * (KV_HEADS * GROUP) + head) * tl.num_programs(2) + split, lse, mask=valid_m)


def _merge_kernel(part_ptr, lse_ptr, out_ptr, SPLITS, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per output row r (a flattened (b, t, head)): part [R, SPLITS, D] f32, lse [R, SPLITS]
    # -> out [R, D]; the splits are weighed by their share of the softmax mass, in one fixed order
    r = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    valid_s = offs_s < SPLITS
    lse = tl.load(lse_ptr + r * SPLITS + offs_s, mask=valid_s, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))          # an empty split: exactly 0
    parts = tl.load(part_ptr + (r * SPLITS + offs_s[:, None]) * D + offs_d[None, :],
                    mask=valid_s[:, None] & (offs_d[None, :] < D), other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + r * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


_jitted = False


def jit_kernels() -> None:
    """Jit the device functions, then the kernel (also the latent kernel's device functions)."""
    global _jitted, _attention_kernel, _merge_kernel, _online_softmax_dev, _split_range_dev, _finish_dev
    if _jitted:
        return
    if triton is None:
        raise RuntimeError("triton is not installed")
    _online_softmax_dev = triton.jit(_online_softmax_dev)
    _split_range_dev = triton.jit(_split_range_dev)
    _finish_dev = triton.jit(_finish_dev)
    _attention_kernel = triton.jit(_attention_kernel)
    _merge_kernel = triton.jit(_merge_kernel)
    _jitted = True


if kn.should_jit_at_import():
    jit_kernels()


# Split-K (flash-decoding) on the step: a row's keys are cut into fixed chunks, one split per MIN_CHUNK
# keys of the cache, at most MAX_SPLITS; chunks start at multiples of CHUNK_ALIGN, which every BLOCK_N
# of kernels/launch_configs.py divides (so a chunk's key blocks are the same whatever the tile).
MIN_CHUNK = 256
MAX_SPLITS = 16
CHUNK_ALIGN = 64


def choose_splits(max_len: int) -> int:
    """Splits of a decode step's rows over a cache of `max_len` positions. A function of the cache
    alone (not of the batch, T or the device), so that a query is reduced in the same order in a plain
    step, a K = 3 step and at any batch size (GPU_NOTES 2)."""
    return max(1, min(MAX_SPLITS, -(-max_len // MIN_CHUNK)))


def split_chunk(max_len: int, splits: int) -> int:
    """Keys per split: the cache cut in `splits` equal parts, rounded up to a multiple of CHUNK_ALIGN."""
    return -(-max(1, -(-max_len // splits)) // CHUNK_ALIGN) * CHUNK_ALIGN


def query_tiles(queries: int, group: int, block_m: int) -> int:
    return -(-queries * group // block_m)


def attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     positions: torch.Tensor, scale: float, splits: int = 1) -> torch.Tensor:
    """Guarded launch of `_attention_kernel` (+ the log-sum-exp merge of the splits), tiles from
    kernels/launch_configs.py."""
    # q: [B, T, Hq, D]; caches: [S, Hkv, L, D]; rows: [B]; positions: [B, T]
    if not _jitted:
        jit_kernels()
    B, T, Hq, D = q.shape
    S, Hkv, L, Dk = k_cache.shape
    assert Dk == D and v_cache.shape == k_cache.shape, "k/v caches must be [S, Hkv, L, D] like q's D"
    assert Hq % Hkv == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "the head dimension must be contiguous"
    assert v_cache.stride() == k_cache.stride(), "k and v caches must share strides"
    assert k_cache.dtype == v_cache.dtype == q.dtype, "q and the caches must share a dtype"
    assert rows.shape == (B,) and positions.shape == (B, T), "rows: [B], positions: [B, T]"
    assert rows.dtype == torch.int64 and positions.dtype == torch.int64
    assert positions.is_contiguous() and rows.is_contiguous()
    assert all(t.device == q.device for t in (k_cache, v_cache, rows, positions))
    launch = launch_configs.attention(q.dtype, D)
    group = Hq // Hkv
    tiles = query_tiles(T, group, launch.tiles["BLOCK_M"])
    part = torch.empty(B, T, Hq, splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, Hq, splits, dtype=torch.float32, device=q.device)
    if B * T == 0:
        return q.new_empty(q.shape)
    _attention_kernel[(B * Hkv, tiles, splits)](
        q, k_cache, v_cache, rows, positions, part, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        part.stride(0), part.stride(1), part.stride(2), part.stride(3),
        T, D, float(scale), split_chunk(L, splits),
        GROUP=group, KV_HEADS=Hkv, BLOCK_D=launch_configs.padded_head_dim(D), IEEE=q.dtype == torch.float32,
        **launch.tiles, num_warps=launch.num_warps, num_stages=launch.num_stages,
    )
    return merge_splits_triton(part, lse, q.dtype)


def merge_splits(part: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The splits' partial outputs weighted by their share of the softmax mass (flash-decoding): the
    reference of `_merge_kernel`."""
    # part: [B, T, H, SPLITS, D] float32; lse: [B, T, H, SPLITS] -> [B, T, H, D] in `dtype`
    if part.shape[3] == 1:
        return part[:, :, :, 0].to(dtype)
    weight = torch.softmax(lse, dim=-1)  # exp(lse_s - logsumexp(lse)); empty splits have lse = -inf
    return (part * weight.unsqueeze(-1)).sum(dim=3).to(dtype)


def merge_splits_triton(part: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`merge_splits` as one kernel launch (eager, it is four: softmax, product, sum, cast)."""
    # part: [B, T, H, SPLITS, D] float32 contiguous; lse: [B, T, H, SPLITS] -> [B, T, H, D] in `dtype`
    if not _jitted:
        jit_kernels()
    *lead, splits, D = part.shape
    if splits == 1:
        return part[:, :, :, 0].to(dtype)
    assert part.is_contiguous() and lse.is_contiguous() and part.dtype == lse.dtype == torch.float32
    out = torch.empty(*lead, D, dtype=dtype, device=part.device)
    rows = out.numel() // max(D, 1)
    if rows:
        merge = launch_configs.MERGE
        _merge_kernel[(rows,)](part, lse, out, splits, D, BLOCK_S=triton.next_power_of_2(splits),
                               BLOCK_D=launch_configs.padded_head_dim(D),
                               num_warps=merge.num_warps, num_stages=merge.num_stages)
    return out


@torch.library.custom_op("specgen::cached_attention", mutates_args=())
def cached_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                     positions: torch.Tensor, scale: float, splits: int) -> torch.Tensor:
    return attention_triton(q, k_cache, v_cache, rows, positions, scale, splits)


@cached_attention.register_fake
def _(q, k_cache, v_cache, rows, positions, scale, splits):
    return q.new_empty(q.shape)
