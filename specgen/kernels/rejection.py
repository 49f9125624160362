"""Verification of draft tokens against the target: Triton kernel, guarded wrapper, PyTorch reference.

Contract (DESIGN.md section 4; ALGORITHMS.md sections 4.1-4.4). Inputs for B requests and K drafts:
  logprobs      [B, K+1, V] f32  processed target log-probabilities (raw logits for greedy rows);
                                 row i predicts the token at absolute position positions[b, i]
  draft_tokens  [B, K]      i64  draft x_i proposed for row i
  draft_probs   [B, K, V]   f32  the distribution q_i each x_i was sampled from, or None (one-hot drafts)
  greedy        [B]         bool
  noise_key     [B]         i64  per-request key in [0, 2**32) (keyed_noise.noise_key_for)
  positions     [B, K+1]    i64
  relaxed       [B, K]      bool drafts to accept even where the rule below rejects them, or None
                                 (relaxed acceptance, lossy: specgen.pipelines.relaxed)
Outputs: accepted [B] i64 in 0..K, emitted [B, K+1] i64 (accepted drafts, then one correction or
bonus token, then -1) and relaxed_accepted [B] i64 (accepted drafts that only `relaxed` accepted).

Target sample of row i: y_i = argmax_v(logprobs[b, i, v] + g(key, positions[b, i], v, TARGET)), or the
plain argmax for greedy rows. Ties go to the lowest index in both implementations.
- One-hot rule (draft_probs None, and always for greedy rows): accept x_i iff x_i == y_i; emit y at
  the first mismatch, or the bonus y_K. Every emitted token is then the token plain decoding (K = 0)
  samples at that position, so seeded speculative output equals seeded plain output (without
  `relaxed`, which accepts tokens the target would not have sampled).
- Rejection rule (draft_probs given, sampled rows): with p = exp(logprobs), q = draft_probs, accept
  x_i iff u(key, pos_i, 0, ACCEPT) * q_i(x_i) < p_i(x_i), i.e. with probability min(1, p/q). At the
  first rejection emit argmax_v(log max(p_i - q_i, 0) + g(key, pos_i, v, RESIDUAL)); if that residual
  is zero everywhere, emit y_i. If all K are accepted, emit the bonus y_K.
- Relaxed rows: where relaxed[b, i] holds, x_i is accepted whatever the rule above says. The first
  row that neither accepts is corrected as above.
K = 0 is plain sampling through the same code.

Nothing here synchronises with the host, so both paths can sit inside a compiled / graphed step;
for the same reason nothing checks values: draft tokens must lie in [0, V) (the kernel reads p and q
at x_i unchecked). Kernel and reference agree exactly on the integer noise; their exp/log may differ
in the last bit (GPU approximations, numpy in the interpreter), which can only flip a decision at a
floating-point near-tie.
"""

from __future__ import annotations

import torch

from . import keyed_noise as kn
from . import launch_configs
from .keyed_noise import ACCEPT, RESIDUAL, STREAM_SALT, TARGET, tl, triton

# ---------------------------------------------------------------------------------------------------
# PyTorch reference
# ---------------------------------------------------------------------------------------------------


def sample_rows(
    logprobs: torch.Tensor,
    greedy: torch.Tensor,
    noise_key: torch.Tensor,
    positions: torch.Tensor,
    stream: int = TARGET,
) -> torch.Tensor:
    """Gumbel-max sample per row (argmax for greedy rows): [B, T, V] -> [B, T] int64."""
    # logprobs: [B, T, V]; greedy: [B]; noise_key: [B]; positions: [B, T]
    vocab = torch.arange(logprobs.shape[-1], device=logprobs.device)
    g = kn.gumbel(noise_key, positions, vocab, stream)
    scores = torch.where(greedy[:, None, None], logprobs, logprobs + g)
    return scores.argmax(dim=-1)  # first maximum on ties, like the kernel


def verify_greedy(logprobs: torch.Tensor, draft_tokens: torch.Tensor, relaxed: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference for batches whose rows are all greedy: no noise is computed at all."""
    # logprobs: [B, K+1, V]; draft_tokens: [B, K]; relaxed: [B, K] | None
    y = logprobs.argmax(dim=-1)
    accepted, relaxed_accepted = _accepted_prefix(draft_tokens == y[:, :-1], relaxed)
    final = y.gather(1, accepted[:, None]).squeeze(1)
    return accepted, _emitted(accepted, draft_tokens, final), relaxed_accepted


def _accepted_prefix(strict: torch.Tensor, relaxed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """strict, relaxed [B, K] bool -> the accepted prefix length [B] and how many of its drafts only
    the relaxed rule accepted [B]."""
    accept = strict if relaxed is None else strict | relaxed
    # the first rejected position (K when none is): a min over K + 1 entries, never an empty
    # reduction, so one compiled step serves K = 0 (plain decoding) and every K > 0 alike
    K = accept.shape[1]
    index = torch.arange(K + 1, device=accept.device)
    rejected = torch.cat((~accept, accept.new_ones(accept.shape[0], 1)), dim=1)
    accepted = torch.where(rejected, index, K + 1).amin(dim=1)
    if relaxed is None:
        return accepted, torch.zeros_like(accepted)
    in_prefix = torch.arange(strict.shape[1], device=strict.device) < accepted[:, None]
    return accepted, (relaxed & ~strict & in_prefix).sum(dim=1)


def _emitted(accepted: torch.Tensor, draft_tokens: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    # accepted, final: [B]; draft_tokens: [B, K] -> [B, K+1]: accepted drafts, final token, then -1
    B, K = draft_tokens.shape
    j = torch.arange(K + 1, device=draft_tokens.device)
    drafts = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), -1)], dim=1)
    n = accepted[:, None]
    return torch.where(j < n, drafts, torch.where(j == n, final[:, None], -1))


def verify_reference(
    logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    noise_key: torch.Tensor,
    positions: torch.Tensor,
    relaxed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vectorised PyTorch implementation of the contract above (no loop over B or K)."""
    # logprobs: [B, K+1, V]; draft_tokens: [B, K]; draft_probs: [B, K, V] | None
    # greedy: [B]; noise_key: [B]; positions: [B, K+1]; relaxed: [B, K] | None
    B, K1, V = logprobs.shape
    K = K1 - 1
    device = logprobs.device
    y = sample_rows(logprobs, greedy, noise_key, positions, TARGET)  # [B, K+1]
    match = draft_tokens == y[:, :K]  # [B, K]
    if draft_probs is None:
        accept = match
    else:
        x = draft_tokens[:, :, None]
        p_x = logprobs[:, :K].gather(-1, x).squeeze(-1).exp()
        q_x = draft_probs.gather(-1, x).squeeze(-1)
        u = kn.uniform(noise_key, positions[:, :K], torch.zeros(1, dtype=torch.long, device=device), ACCEPT)
        # u * q < p accepts with probability min(1, p / q) without dividing
        accept = torch.where(greedy[:, None], match, u[..., 0] * q_x < p_x)
    accepted, relaxed_accepted = _accepted_prefix(accept, relaxed)  # [B], [B]
    final = y.gather(1, accepted[:, None]).squeeze(1)  # correction (one-hot) or bonus: [B]
    if draft_probs is not None and K > 0:
        # residual sample at the first rejected row (clamped: rows that accepted all K ignore it)
        r = accepted.clamp(max=K - 1)[:, None]  # [B, 1]
        lp_r = logprobs.gather(1, r[:, :, None].expand(B, 1, V))  # [B, 1, V]
        q_r = draft_probs.gather(1, r[:, :, None].expand(B, 1, V))
        residual = (lp_r.exp() - q_r).clamp_min(0.0)
        vocab = torch.arange(V, device=device)
        g = kn.gumbel(noise_key, positions.gather(1, r), vocab, RESIDUAL)
        z = (residual.log() + g).argmax(dim=-1).squeeze(1)  # log(0) = -inf drops tokens with p <= q
        # an all-zero residual (p == q) falls back to the target sample y
        use_residual = ~greedy & (accepted < K) & (residual > 0).any(dim=-1).squeeze(1)
        final = torch.where(use_residual, z, final)
    return accepted, _emitted(accepted, draft_tokens, final), relaxed_accepted


# ---------------------------------------------------------------------------------------------------
# Triton kernel. Plain functions jitted on first use (see keyed_noise's docstring for why); the
# annotations are strings (`from __future__ import annotations`), which is all triton reads.
# ---------------------------------------------------------------------------------------------------


def _argmax_row_dev(lp_row, key, pos, use_noise, SALT: tl.constexpr, V, BLOCK_V: tl.constexpr):
    # argmax_v(lp_row[v] + g(key, pos, v)) (or plain argmax), blockwise with a running max + index
    row = kn._row_hash_dev(key, pos, SALT)
    best = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        s = tl.load(lp_row + offs, mask=offs < V, other=float("-inf"))
        if use_noise:
            s = s + kn._gumbel_dev(row, offs.to(tl.uint32))
        chunk_best = tl.max(s, axis=0)
        # lowest index among the chunk's maxima; strict `>` below keeps earlier chunks on ties
        chunk_idx = tl.min(tl.where(s == chunk_best, offs, V), axis=0)
        better = chunk_best > best
        best = tl.where(better, chunk_best, best)
        best_idx = tl.where(better, chunk_idx, best_idx)
    return best_idx.to(tl.int64)


def _residual_row_dev(lp_row, dp_row, key, pos, SALT: tl.constexpr, V, BLOCK_V: tl.constexpr):
    # argmax_v(log max(p - q, 0) + g(key, pos, v)); `found` is False when the residual is all zero
    row = kn._row_hash_dev(key, pos, SALT)
    best = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.exp(tl.load(lp_row + offs, mask=mask, other=float("-inf")))
        q = tl.load(dp_row + offs, mask=mask, other=0.0)
        r = p - q
        positive = r > 0
        # log of a safe argument, so that no lane takes log(0) (the interpreter would warn)
        s = tl.where(positive, tl.log(tl.where(positive, r, 1.0)) + kn._gumbel_dev(row, offs.to(tl.uint32)),
                     float("-inf"))
        chunk_best = tl.max(s, axis=0)
        chunk_idx = tl.min(tl.where(s == chunk_best, offs, V), axis=0)
        better = chunk_best > best
        best = tl.where(better, chunk_best, best)
        best_idx = tl.where(better, chunk_idx, best_idx)
    return best_idx.to(tl.int64), best > float("-inf")


def _verify_kernel(
    logprobs_ptr,  # [B, K+1, V] f32
    draft_tokens_ptr,  # [B, K] i64
    draft_probs_ptr,  # [B, K, V] f32 (any f32 pointer when not HAS_DRAFT_PROBS)
    greedy_ptr,  # [B] bool
    noise_key_ptr,  # [B] i64
    positions_ptr,  # [B, K+1] i64
    relaxed_ptr,  # [B, K] bool (any pointer when not HAS_RELAXED)
    accepted_ptr,  # [B] i64 (out)
    emitted_ptr,  # [B, K+1] i64 (out)
    relaxed_accepted_ptr,  # [B] i64 (out)
    K,
    V,
    SALT_TARGET: tl.constexpr,
    SALT_ACCEPT: tl.constexpr,
    SALT_RESIDUAL: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    HAS_RELAXED: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,  # power of two >= K + 1, for the -1 padding store
):
    # one program per request; rows are visited in order and the loop stops at the first rejection
    b = tl.program_id(0).to(tl.int64)  # int64 so that offsets into [B, K+1, V] cannot overflow
    key = tl.load(noise_key_ptr + b).to(tl.uint32)
    sampled = tl.load(greedy_ptr + b) == 0
    row0 = b * (K + 1)
    # loop-carried values must be tensors from the start, hence these spellings of 0 and True
    n_accepted = b * 0
    n_relaxed = b * 0
    going = b >= 0
    for i in range(0, K + 1):
        if going:
            lp_row = logprobs_ptr + (row0 + i) * V
            pos = tl.load(positions_ptr + row0 + i).to(tl.uint32)
            has_draft = i < K
            x = tl.load(draft_tokens_ptr + b * K + i, mask=has_draft, other=-1)
            if HAS_RELAXED:
                relax = tl.load(relaxed_ptr + b * K + i, mask=has_draft, other=0) != 0
            else:
                relax = has_draft & False
            stochastic = has_draft & sampled & HAS_DRAFT_PROBS
            if stochastic:
                dp_row = draft_probs_ptr + (b * K + i) * V
                p_x = tl.exp(tl.load(lp_row + x))
                q_x = tl.load(dp_row + x)
                u = kn._uniform_dev(kn._row_hash_dev(key, pos, SALT_ACCEPT), 0)
                ok = u * q_x < p_x
                tok = x
                if (ok == 0) & (relax == 0):   # a relaxed acceptance needs no residual sample
                    tok, found = _residual_row_dev(lp_row, dp_row, key, pos, SALT_RESIDUAL, V, BLOCK_V)
                    if not found:
                        tok = _argmax_row_dev(lp_row, key, pos, True, SALT_TARGET, V, BLOCK_V)
            else:
                tok = _argmax_row_dev(lp_row, key, pos, sampled, SALT_TARGET, V, BLOCK_V)
                ok = has_draft & (x == tok)
            only_relaxed = relax & (ok == 0)
            tok = tl.where(only_relaxed, x, tok)
            ok = ok | only_relaxed
            tl.store(emitted_ptr + row0 + i, tok)
            n_accepted += ok.to(tl.int64)
            n_relaxed += only_relaxed.to(tl.int64)
            going = ok
    tl.store(accepted_ptr + b, n_accepted)
    tl.store(relaxed_accepted_ptr + b, n_relaxed)
    offs = tl.arange(0, BLOCK_K)
    tl.store(emitted_ptr + row0 + offs, tl.full([BLOCK_K], -1, tl.int64), mask=(offs > n_accepted) & (offs <= K))


_KERNEL_FUNCTIONS = ("_argmax_row_dev", "_residual_row_dev", "_verify_kernel")
_jitted = False


def jit_kernels() -> None:
    """Decorate the kernel functions (idempotent). Call it before torch.compile traces `verify_triton`;
    it runs at import already when CUDA or TRITON_INTERPRET=1 is present."""
    global _jitted
    if _jitted:
        return
    kn.jit_device_functions()
    g = globals()
    for name in _KERNEL_FUNCTIONS:
        g[name] = triton.jit(g[name])
    _jitted = True


if kn.should_jit_at_import():
    jit_kernels()


def verify_triton(
    logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    noise_key: torch.Tensor,
    positions: torch.Tensor,
    relaxed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Guarded launch of `_verify_kernel`: same contract and results as `verify_reference`; its launch
    from kernels/launch_configs.py."""
    # logprobs: [B, K+1, V]; draft_tokens: [B, K]; draft_probs: [B, K, V] | None
    # greedy: [B]; noise_key: [B]; positions: [B, K+1]; relaxed: [B, K] | None
    if not _jitted:
        jit_kernels()
    assert logprobs.dim() == 3, "logprobs must be [B, K+1, V]"
    B, K1, V = logprobs.shape
    K = K1 - 1
    assert K1 >= 1, "logprobs needs at least one row (K = 0)"
    assert logprobs.dtype == torch.float32, "logprobs must be float32"
    assert draft_tokens.dtype == torch.int64 and draft_tokens.shape == (B, K), "draft_tokens: [B, K] int64"
    assert greedy.dtype == torch.bool and greedy.shape == (B,), "greedy: [B] bool"
    assert noise_key.dtype == torch.int64 and noise_key.shape == (B,), "noise_key: [B] int64"
    assert positions.dtype == torch.int64 and positions.shape == (B, K1), "positions: [B, K+1] int64"
    tensors = [logprobs, draft_tokens, greedy, noise_key, positions]
    if draft_probs is not None:
        assert draft_probs.dtype == torch.float32 and draft_probs.shape == (B, K, V), "draft_probs: [B, K, V] f32"
        tensors.append(draft_probs)
    if relaxed is not None:
        assert relaxed.dtype == torch.bool and relaxed.shape == (B, K), "relaxed: [B, K] bool"
        tensors.append(relaxed)
    assert all(t.is_contiguous() for t in tensors), "verify_triton needs contiguous inputs"
    assert all(t.device == logprobs.device for t in tensors), "verify_triton inputs must share a device"

    accepted = torch.empty(B, dtype=torch.int64, device=logprobs.device)
    emitted = torch.empty(B, K1, dtype=torch.int64, device=logprobs.device)
    relaxed_accepted = torch.empty(B, dtype=torch.int64, device=logprobs.device)
    if B == 0:
        return accepted, emitted, relaxed_accepted
    _verify_kernel[(B,)](
        logprobs,
        draft_tokens,
        draft_probs if draft_probs is not None else logprobs,
        greedy,
        noise_key,
        positions,
        relaxed if relaxed is not None else greedy,
        accepted,
        emitted,
        relaxed_accepted,
        K,
        V,
        SALT_TARGET=STREAM_SALT[TARGET],
        SALT_ACCEPT=STREAM_SALT[ACCEPT],
        SALT_RESIDUAL=STREAM_SALT[RESIDUAL],
        HAS_DRAFT_PROBS=draft_probs is not None,
        HAS_RELAXED=relaxed is not None,
        BLOCK_K=triton.next_power_of_2(K1),
        **launch_configs.VERIFY.tiles,
        num_warps=launch_configs.VERIFY.num_warps,
        num_stages=launch_configs.VERIFY.num_stages,
    )
    return accepted, emitted, relaxed_accepted


@torch.library.custom_op("specgen::verify", mutates_args=())
def verify_op(
    logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    noise_key: torch.Tensor,
    positions: torch.Tensor,
    relaxed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`verify_triton` as an opaque custom op: torch.compile calls it as one extern node and CUDA
    graphs capture its launch. (Traced as Python, Inductor would re-emit the kernel's source and
    lose the module-qualified device functions it calls: GPU_NOTES 1.)"""
    return verify_triton(logprobs, draft_tokens, draft_probs, greedy, noise_key, positions, relaxed)


@verify_op.register_fake
def _(logprobs, draft_tokens, draft_probs, greedy, noise_key, positions, relaxed):
    B, K1, _ = logprobs.shape
    return (logprobs.new_empty(B, dtype=torch.int64), logprobs.new_empty(B, K1, dtype=torch.int64),
            logprobs.new_empty(B, dtype=torch.int64))
