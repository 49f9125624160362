"""Per-slot sampling parameters, logits -> processed log-probabilities, and draft sampling.

Contract:
- `process_logits` turns logits into the distribution the user asked for. The target and every draft
  go through the same function with the same `SamplingTensors`, which is what keeps verification
  lossless (ALGORITHMS.md section 4.2: q must be processed exactly like p).
  Order, as in vLLM: temperature, then top-k, then top-p, then min-p; the result is log_softmax over
  the surviving tokens, the rest are -inf. Greedy rows (temperature 0) come back as the raw logits in
  float32: only their argmax is ever used.
- `sample_draft` draws one stochastic draft token per row with position-keyed Gumbel noise (stream
  DRAFT) and returns the distribution it was drawn from, ready to be `draft_probs` for `verify`.
- No host synchronisation in either function (no `.item()`, `.tolist()` or branching on tensor
  values): they run inside the compiled step. The only Python branches read the static flags of
  `SamplingTensors`, which skip work no row needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specgen.kernels import keyed_noise as kn


@dataclass(slots=True)
class SamplingTensors:
    """Sampling parameters of the B batch slots, on the device, plus static flags computed on the host.

    The flags describe the widest use ever seen: `build` sets them from the initial rows and
    `update_row` only ever widens them (a slot refilled with greedy parameters does not clear
    `use_top_p`). A compiled step therefore never loses a feature a row needs; the price is that a
    flag that widens after compilation changes a guard (one recompile). Build from the recipe once,
    with every slot holding the recipe's parameters, and the flags never change.
    """

    temperature: torch.Tensor  # [B] f32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] f32, 1 = off
    min_p: torch.Tensor  # [B] f32, 0 = off
    greedy: torch.Tensor  # [B] bool, temperature == 0
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    # The largest top_k of any sampled row (0: none), and the same when EVERY sampled row has a top-k
    # (else 0): then all survivors sit among that many largest logits and top-p needs no more.
    max_top_k: int = 0
    top_k_window: int = 0

    @classmethod
    def build(
        cls,
        temperature: list[float],
        top_k: list[int],
        top_p: list[float],
        min_p: list[float],
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        B = len(temperature)
        if not (len(top_k) == len(top_p) == len(min_p) == B):
            raise ValueError("temperature, top_k, top_p and min_p need one entry per slot")
        for row in zip(temperature, top_k, top_p, min_p):
            _check_row(*row)
        greedy = [t == 0 for t in temperature]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            # filters on greedy rows change nothing (argmax survives every filter): no flag for them
            use_top_k=any(k > 0 and not g for k, g in zip(top_k, greedy)),
            use_top_p=any(p < 1 and not g for p, g in zip(top_p, greedy)),
            use_min_p=any(m > 0 and not g for m, g in zip(min_p, greedy)),
            max_top_k=_largest_top_k(top_k, greedy),
            top_k_window=_window(top_k, greedy),
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        """The parameters of some slots (a slot's prefill), with the same static flags."""
        return SamplingTensors(self.temperature[rows], self.top_k[rows], self.top_p[rows],
                               self.min_p[rows], self.greedy[rows], self.all_greedy, self.use_top_k,
                               self.use_top_p, self.use_min_p, self.max_top_k, self.top_k_window)

    def tensors(self) -> list[torch.Tensor]:
        """The per-slot tensors (slot = dim 0)."""
        return [self.temperature, self.top_k, self.top_p, self.min_p, self.greedy]

    def update_row(self, b: int, temperature: float, top_k: int, top_p: float, min_p: float) -> None:
        """Refill slot b in place (host-to-device copies; call it outside the compiled step)."""
        _check_row(temperature, top_k, top_p, min_p)
        greedy = temperature == 0
        self.temperature[b] = temperature
        self.top_k[b] = top_k
        self.top_p[b] = top_p
        self.min_p[b] = min_p
        self.greedy[b] = greedy
        # widen only, see the class docstring
        self.all_greedy = self.all_greedy and greedy
        self.use_top_k = self.use_top_k or (top_k > 0 and not greedy)
        self.use_top_p = self.use_top_p or (top_p < 1 and not greedy)
        self.use_min_p = self.use_min_p or (min_p > 0 and not greedy)
        # widen only, like the flags: a window once lost (a row without top-k) stays lost
        top_k_all, greedy_all = self.top_k.tolist(), self.greedy.tolist()
        self.max_top_k = max(self.max_top_k, _largest_top_k(top_k_all, greedy_all))
        window = _window(top_k_all, greedy_all)
        self.top_k_window = max(self.top_k_window, window) if window and self.top_k_window else 0


def _largest_top_k(top_k: list[int], greedy: list[bool]) -> int:
    return max((k for k, g in zip(top_k, greedy) if not g), default=0)


def _window(top_k: list[int], greedy: list[bool]) -> int:
    sampled = [k for k, g in zip(top_k, greedy) if not g]
    return max(sampled) if sampled and all(k > 0 for k in sampled) else 0


def _check_row(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {min_p}")


def process_logits(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Logits -> log-probabilities after temperature, top-k, top-p, min-p (in that order).

    - top-k keeps the k largest logits; ties with the k-th value are kept too (vLLM).
    - top-p keeps the smallest set of most likely tokens whose probability reaches top_p, i.e. token
      of rank r survives iff the mass of the tokens ranked above it is < top_p; the top token always
      survives.
    - min-p drops tokens with prob < min_p * max prob, computed as logit < max logit + log(min_p)
      (same thing; the ratio does not depend on the normalisation, so earlier filters do not move it).
    Greedy rows return the raw logits as float32.
    """
    # logits: [B, T, V]; params rows: [B]
    raw = logits.float()
    if params.all_greedy:
        return raw
    greedy = params.greedy[:, None, None]
    # greedy rows divide by 1 so that no inf/nan is formed; their result is replaced below anyway
    temperature = torch.where(params.greedy, 1.0, params.temperature)[:, None, None]
    x = raw / temperature
    if params.use_top_k or params.use_top_p:
        x = _top_k_top_p(x, params)
    if params.use_min_p:
        threshold = x.amax(dim=-1, keepdim=True) + torch.log(params.min_p)[:, None, None]
        x = x.masked_fill(x < threshold, float("-inf"))  # log(0) = -inf: rows with min_p 0 keep all
    return torch.where(greedy, raw, torch.log_softmax(x, dim=-1))


def _top_k_top_p(x: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    # x: [B, T, V] temperature-scaled logits. Skipped by the caller when no row uses either filter.
    # No full-vocabulary sort (60 ms for 32 rows of 49k on 2 CPU cores): top-k takes the largest
    # `max_top_k` logits (torch.topk); top-p finds its cut-off inside that window when every sampled
    # row has a top-k, else by a radix select over the logits' bits.
    kmax = min(params.max_top_k, x.shape[-1])
    ranked = torch.topk(x, kmax, dim=-1).values if kmax else None       # [B, T, kmax], descending
    if params.use_top_k:
        k = torch.where(params.top_k > 0, params.top_k.clamp(max=kmax), 0)           # [B], 0 = off
        kth = ranked.gather(-1, (k - 1).clamp(min=0)[:, None, None].expand(*x.shape[:2], 1))
        kth = torch.where((k > 0)[:, None, None], kth, float("-inf"))
        ranked = ranked.masked_fill(ranked < kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))                          # ties with the k-th stay
    if params.use_top_p:
        if params.top_k_window:
            x = _top_p_in_window(x, ranked, params.top_p)
        else:
            x = _top_p_by_radix_select(x, params.top_p)
    return x


def _top_p_in_window(x: torch.Tensor, ranked: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches top_p (rank order: by value, then by id).

    `ranked` holds the largest logits of each row in descending order (the whole row, or a window
    that holds every survivor) and `x` the logits the filter applies to (-inf for tokens already
    dropped). Token of rank r survives iff the mass ranked above it is < top_p; the top one always."""
    # x: [B, T, V]; ranked: [B, T, W] with W <= V; top_p: [B]
    p = top_p[:, None, None]
    log_total = torch.logsumexp(x, dim=-1, keepdim=True)
    probs = torch.exp(ranked - log_total)
    mass_above = probs.cumsum(dim=-1) - probs  # exclusive prefix sum; exactly 0 at rank 0
    keep = mass_above < p
    keep[..., 0] = True  # the top token always survives, whatever rounding does
    threshold = ranked.gather(-1, keep.sum(dim=-1, keepdim=True) - 1)  # the last survivor's value
    # Tokens above the threshold survive. Of those equal to it (ids in increasing order, as a stable
    # sort ranks them; they may run past a window), the r-th survives while mass(above) + r * p(it)
    # < top_p; computed from the threshold's first rank, so ties past the window count too.
    first = (ranked > threshold).sum(dim=-1, keepdim=True)
    mass_over = mass_above.gather(-1, first)
    p_tie = probs.gather(-1, first)
    return _keep_through_ties(x, x > threshold, x == threshold, p - mass_over, p_tie, p)


def _keep_through_ties(x, above, tied, room, p_tie, p):
    """Keep `above`, and of the `tied` tokens (ids in increasing order, as a stable sort ranks them)
    the r-th while r * p_tie < room (the mass still allowed); rows with top_p >= 1 keep all."""
    allowed = torch.ceil(room / p_tie).clamp(min=1)
    survive = above | (tied & (tied.cumsum(dim=-1) <= allowed))
    # rounding can push a float32 mass to 1 before the tail: top_p == 1 must mean off
    return torch.where((p >= 1) | survive, x, float("-inf"))


# Radix select over an order-preserving 32-bit key, 11 + 11 + 10 bits at a time.
_RADIX_DIGITS = ((21, 11), (10, 11), (0, 10))
_INT32_MIN = -(2**31)
_MASS_SCALE = 2.0**40         # top-p's masses in fixed point: 2**40 x the whole mass fits int64


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 whose bit pattern, read unsigned, orders like the floats (-inf smallest):
    negative floats get all bits flipped, the others only the sign bit."""
    bits = x.contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) | _INT32_MIN)


def _key_to_float(key: torch.Tensor) -> torch.Tensor:
    """The inverse of `_order_key` for keys held as int64 in [0, 2**32)."""
    bits = torch.where(key >= 2**31, key - 2**31, key ^ 0xFFFFFFFF)   # uint32 pattern of the float
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def _top_p_by_radix_select(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p without sorting: the cut-off logit is found digit by digit from the probability mass in
    each bucket of an order-preserving key (three passes over the row), then ties are resolved as a
    stable sort would. Same survivors as the sorted definition, up to the masses' rounding.

    The masses are sums in fixed point (multiples of 2**-40, int64): integer sums are exact in any
    order, so a bucket's mass does not depend on the order its tokens are added in, which on CUDA
    (atomic adds in `scatter_add_`) changes from run to run, nor on where in the vocabulary they sit."""
    # x: [B, T, V] float32 (-inf = already dropped); top_p: [B]
    p = top_p[:, None, None]
    log_total = torch.logsumexp(x, dim=-1, keepdim=True)
    probs = torch.exp(x - log_total)
    fixed = torch.round(probs * _MASS_SCALE).long()                    # exact: the scale is 2**40
    key = _order_key(x + 0.0)          # + 0.0 turns -0.0 into +0.0: one key for one compared value
    cutoff = torch.zeros_like(log_total, dtype=torch.int64)            # the cut-off's key, digit by digit
    need = torch.round(p.double() * _MASS_SCALE).long().expand_as(cutoff).clone()   # mass still to reach
    for shift, width in _RADIX_DIGITS:
        digit = ((key >> shift) & ((1 << width) - 1)).long()
        weight = fixed
        if shift + width < 32:   # only keys that share the digits chosen so far
            higher = -(1 << (shift + width))                           # mask of the digits above
            weight = fixed.masked_fill((key & higher) != _as_int32(cutoff & higher), 0)
        mass = torch.zeros(*x.shape[:2], 1 << width, dtype=torch.int64, device=x.device)
        mass.scatter_add_(-1, digit, weight)
        at_or_above = mass.flip(-1).cumsum(-1).flip(-1)               # mass of buckets >= b
        # never more than the candidates hold (rounding): then their lowest bucket is chosen
        need = torch.minimum(need, at_or_above[..., :1])
        buckets = torch.arange(1 << width, device=x.device)
        # the cut-off's bucket: the highest whose buckets at or above hold what is still needed
        chosen = torch.where(at_or_above >= need, buckets, 0).amax(dim=-1, keepdim=True)
        need = need - (at_or_above.gather(-1, chosen) - mass.gather(-1, chosen))
        cutoff = cutoff | (chosen << shift)
    threshold = _key_to_float(cutoff)
    p_tie = torch.exp(threshold - log_total)
    return _keep_through_ties(x, x > threshold, x == threshold, need.to(x.dtype) / _MASS_SCALE, p_tie, p)


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    # int64 holding a 32-bit pattern -> int32 with that pattern
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def sample_draft(
    logprobs: torch.Tensor,
    greedy: torch.Tensor,
    noise_key: torch.Tensor,
    position: torch.Tensor,
    stream: int = kn.DRAFT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft token per row and the distribution it was drawn from.

    token = argmax(logprobs + g(key, position, v, stream)) for sampled rows, argmax for greedy rows;
    probs = softmax(logprobs), one-hot at the token for greedy rows. `position` is the absolute position
    the drafted token will occupy (= positions[b, i] of the verify row it is proposed for).

    The DRAFT stream keeps the draft independent of the ACCEPT / RESIDUAL noise, which full rejection
    sampling (`verify` with draft_probs) requires. For one-hot verification (draft_probs=None) any
    draft is lossless, and `stream=kn.TARGET` couples the draft with the target's own sample at that
    position: they agree whenever argmax(log q + g) == argmax(log p + g), more often than independent
    draws do.
    """
    # logprobs: [B, V]; greedy: [B]; noise_key: [B]; position: [B]
    V = logprobs.shape[-1]
    vocab = torch.arange(V, device=logprobs.device)
    g = kn.gumbel(noise_key, position[:, None], vocab, stream)[:, 0]  # [B, V]
    token = torch.where(greedy[:, None], logprobs, logprobs + g).argmax(dim=-1)
    # comparison instead of F.one_hot, whose range check synchronises with the host
    one_hot = (vocab == token[:, None]).to(torch.float32)
    probs = torch.where(greedy[:, None], one_hot, torch.softmax(logprobs.float(), dim=-1))
    return token, probs
