"""The target's log-probabilities of the emitted tokens, from the verify's own logits (no second pass).

Contract:
- `Logprobs(top, mode)`: what a job asks for (`sampling.logprobs: N`, `sampling.logprobs_mode`).
  `processed` (the default, vLLM's `processed_logprobs`): the distribution tokens are sampled from,
  after temperature, top-k, top-p and min-p; a greedy row's is the plain softmax of its logits
  (temperature 1, as vLLM reports greedy requests). `raw`: log_softmax of the logits for every row.
- `pack(view, tokens, top)` runs inside the compiled step: for each row it gathers the log-probability
  of the token emitted there and the `top` most likely (id, log-probability) pairs, and packs them
  into int64 columns (floats as their float32 bits) so that the step's ONE device->host read carries
  them beside the tokens: `width(top) = 1 + 2 * top` columns a token.
- `unpack(columns, token, top)` turns one token's columns back into the record entry
  `{"token_id", "logprob", "top": [[id, logprob], ...]}`. Tokens with probability 0 under the
  processed distribution (filtered by top-k / top-p / min-p) are left out of `top`, which then
  holds fewer than N pairs; the emitted token itself always has a finite log-probability.
A verified token's row comes from the same logits plain decoding computes for it (row-invariant
attention, pipelines/unified.py), so its values do not depend on the draft, k or the batch. The
first token's and the prompt's come from the prefill, whose batching follows which slots are free:
the same to rounding.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from specgen.sampling import SamplingTensors

@dataclass(frozen=True, slots=True)
class Logprobs:
    top: int = 0                 # alternatives per token (0: the emitted token's alone)
    mode: str = "processed"      # processed | raw

    @property
    def width(self) -> int:
        return width(self.top)


def width(top: int) -> int:
    """Packed int64 columns per token."""
    return 1 + 2 * top


def logprob_view(logits: torch.Tensor, processed: torch.Tensor, sampling: SamplingTensors, mode: str) -> torch.Tensor:
    """logits, processed: [B, T, V] (processed = `process_logits(logits)`, whose greedy rows are raw
    logits) -> the log-probabilities to report [B, T, V] float32."""
    plain = torch.log_softmax(logits.float(), -1)
    if mode == "raw" or sampling.all_greedy:
        return plain
    return torch.where(sampling.greedy[:, None, None], plain, processed)


def _bits(x: torch.Tensor) -> torch.Tensor:
    # float32 -> its bits, sign-extended into int64 (unpack reverses it)
    return x.float().contiguous().view(torch.int32).to(torch.int64)


def pack(view: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """view: [B, T, V] log-probabilities; tokens: [B, T] (>= 0) -> [B, T, width(top)] int64."""
    chosen = view.gather(-1, tokens.unsqueeze(-1))                                   # [B, T, 1]
    if top == 0:
        return _bits(chosen)
    values, ids = view.topk(top, dim=-1)                                             # [B, T, top]
    return torch.cat((_bits(chosen), ids, _bits(values)), -1)


def unpack(columns: list[int], token: int, top: int) -> dict:
    """One token's packed columns (pack's layout) -> its record entry. Records are strict JSON: a
    non-finite log-probability (a prompt token the model rules out, NaN from an overflow) is null,
    and leaves `top`."""
    floats = struct.unpack(f"<{1 + top}f", struct.pack(f"<{1 + top}i", columns[0], *columns[1 + top:1 + 2 * top]))
    pairs = [[columns[1 + i], floats[1 + i]] for i in range(top) if math.isfinite(floats[1 + i])]
    return {"token_id": token, "logprob": floats[0] if math.isfinite(floats[0]) else None, "top": pairs}
