"""The one verification entry point, shared by every draft method (DESIGN.md section 4).

Contract: `verify` takes the processed target log-probabilities of K+1 rows per request, the K draft
tokens, optionally the draft distributions and a relaxed-acceptance mask, and returns `accepted [B]`,
`emitted [B, K+1]` and `relaxed_accepted [B]` (drafts only the mask accepted; zeros without one). The rule
(one-hot "sample and match" for greedy rows and argmax / unknown-q drafts, full rejection sampling when
q is given) and the noise definition are documented in `specgen.kernels.rejection` and
`specgen.kernels.keyed_noise`; this module only picks the implementation:
- the Triton kernel on CUDA when triton is importable, as the custom op `specgen::verify` (opaque to
  torch.compile, captured by CUDA graphs);
- the vectorised PyTorch reference otherwise.
`force_kernel=True` runs the kernel anywhere (on CPU it needs TRITON_INTERPRET=1 in the environment
before the kernel is first used); `force_kernel=False` always runs the reference. Both give identical
results up to floating-point near-ties (the kernel's exp/log may differ from PyTorch's in the last
bit; the integer noise is bit-identical).

K = 0 is plain sampling: `verify(logprobs[:, :1], drafts[:, :0], None, greedy, key, positions[:, :1])`.
"""

from __future__ import annotations

import torch

from specgen.kernels import keyed_noise, rejection


def verify(
    logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    noise_key: torch.Tensor,
    positions: torch.Tensor,
    *,
    relaxed: torch.Tensor | None = None,
    all_greedy: bool = False,
    force_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept a prefix of the drafts and emit the tokens of this step.

    logprobs [B, K+1, V] f32 (row i predicts the token at positions[b, i]); draft_tokens [B, K] int64;
    draft_probs [B, K, V] f32 or None (one-hot drafts); greedy [B] bool; noise_key [B] int64;
    positions [B, K+1] int64; relaxed [B, K] bool or None (drafts accepted whatever the rule says:
    pipelines/relaxed.py). Returns accepted [B] int64 in 0..K, emitted [B, K+1] int64 (the accepted
    drafts, then the correction (first rejection) or bonus token, then -1) and relaxed_accepted [B]
    int64. `all_greedy` (a static host flag) skips the noise entirely: every row is argmax-matched.
    """
    # logprobs: [B, K+1, V]; draft_tokens: [B, K]; draft_probs: [B, K, V] | None; positions: [B, K+1]
    if all_greedy and not force_kernel:
        return rejection.verify_greedy(logprobs, draft_tokens, relaxed)
    if force_kernel is None:
        use_kernel = logprobs.is_cuda and keyed_noise.triton_available()
    else:
        use_kernel = force_kernel
    if use_kernel:
        # slices such as logprobs[:, :1] (K = 0) are views; the kernel wants dense rows (no-op if dense)
        return rejection.verify_op(
            logprobs.contiguous(),
            draft_tokens.contiguous(),
            draft_probs.contiguous() if draft_probs is not None else None,
            greedy.contiguous(),
            noise_key.contiguous(),
            positions.contiguous(),
            relaxed.contiguous() if relaxed is not None else None,
        )
    return rejection.verify_reference(logprobs, draft_tokens, draft_probs, greedy, noise_key, positions, relaxed)
