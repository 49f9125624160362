"""Telling rounding from a bug where two greedy runs that should agree do not (bf16, GPU_NOTES item 2).

In bf16 a token verified beside drafts need not get the bits a plain step gives it (a GEMM's kernel
depends on its row count), so greedy speculative and plain decoding may part where two tokens score
almost the same. `rounding_problems` checks each request's FIRST differing position (after it the two
runs continue from different text) against float32 logits of the common prefix, from transformers'
model of the checkpoint (the numeric reference): both tokens must be within `ulps` bf16 units in the
last place of the float32 argmax. A draft or cache bug picks tokens far from the top (a random token
of a tiny random model lies ~2 logits below it; rounding gaps measured 0.002-0.045 at a top of ~2.5,
i.e. at most 3 ulps).
"""

from __future__ import annotations

import math

import torch


def bf16_ulp(x: float) -> float:
    """bf16's spacing at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def first_differences(got: dict[str, list[int]], want: dict[str, list[int]]) -> dict[str, int]:
    """request id -> the first position where the two runs' tokens differ (requests that differ)."""
    out = {}
    for key, a in want.items():
        b = got[key]
        if a != b:
            out[key] = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return out


def float32_logits(checkpoint, ours: bool = False):
    """tokens -> float32 logits of the last position: transformers' model of the checkpoint (the
    numeric reference), or specgen's own on the CPU (`ours`: Kimi K2.5, which transformers does not
    load without remote code; our DeepSeek-V3 / Kimi logits equal transformers', test_deepseek_v3.py)."""
    if not ours:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        return lambda tokens: model(torch.tensor([tokens])).logits[0, -1].float()
    from checkpoints import load_fp32_target
    from model_calls import logits as our_logits

    model = load_fp32_target(checkpoint)

    def last(tokens):
        n = len(tokens)
        cache = model.new_cache(1, n, torch.float32, "cpu")
        return our_logits(model, torch.tensor([tokens]), torch.arange(n).view(1, n), cache, n)[0][0, -1].float()

    return last


def rounding_problems(checkpoint, prompt_ids: list[list[int]], got: dict[str, list[int]],
                      want: dict[str, list[int]], ulps: float = 6.0, ours: bool = False) -> list[str]:
    """Each differing request whose first difference is not a near-tie, described; [] when none.
    Keys are `test_speculative.run`'s ids ("p0", "p1", ...: the index into `prompt_ids`)."""
    differing = first_differences(got, want)
    if not differing:
        return []
    logits_of = float32_logits(checkpoint, ours)
    problems = []
    for key, t in differing.items():
        a, b = want[key], got[key]
        if t >= min(len(a), len(b)):
            problems.append(f"{key}: one run stopped at {t} tokens, the other went on")
            continue
        with torch.no_grad():
            logits = logits_of(prompt_ids[int(key[1:])] + a[:t])
        top = float(logits.max())
        limit = ulps * bf16_ulp(top)
        gaps = {tok: top - float(logits[tok]) for tok in (a[t], b[t])}
        if max(gaps.values()) > limit:
            problems.append(f"{key} at token {t}: {a[t]} vs {b[t]}, {gaps} below the float32 top "
                            f"{top:.3f} (near-tie limit {limit:.3f})")
    return problems


def sampled_rounding_problems(checkpoint, prompt_ids: list[list[int]], got: dict[str, list[int]],
                              want: dict[str, list[int]], *, seed: int, temperature: float,
                              top_p: float = 1.0, ulps: float = 6.0, positions: str = "first",
                              ours: bool = False) -> list[str]:
    """`rounding_problems` for seeded sampling (temperature, top-p). A seeded run samples the token at
    position n as argmax over the kept tokens of logits / T + g(key, n, token) (kernels/keyed_noise.py,
    the TARGET stream; key = noise_key_for(seed, 1000 + i) for `test_speculative.run`'s request i).
    Rounding moves each logit by a few ulps and can move the top-p boundary by as much mass, so a
    token is explained when it lies in the loose top-p set and its perturbed score is within
    `ulps` bf16 units (over T) of the best score of the strict set: a token of some kept set that
    rounding could make win. Checks each differing request's first difference (`positions="all"`:
    every token of `got`, for the self-check on CPU)."""
    from specgen.kernels import keyed_noise as kn

    if positions == "all":
        todo = {key: list(range(len(tokens))) for key, tokens in got.items()}
    else:
        todo = {key: [t] for key, t in first_differences(got, want).items()}
    if not todo:
        return []
    logits_of = float32_logits(checkpoint, ours)
    problems = []
    for key, steps in todo.items():
        i = int(key[1:])
        a, b = want[key], got[key]
        noise_key = torch.tensor([kn.noise_key_for(seed, 1000 + i)])
        for t in steps:
            if t >= min(len(a), len(b)):
                problems.append(f"{key}: one run stopped at {t} tokens, the other went on")
                continue
            with torch.no_grad():
                logits = logits_of(prompt_ids[i] + b[:t])
            tol = ulps * bf16_ulp(float(logits.max())) / temperature
            x = logits / temperature
            probs = torch.softmax(x, dim=-1)
            order = torch.argsort(probs, descending=True)
            above = torch.empty_like(probs)
            above[order] = torch.cumsum(probs[order], 0) - probs[order]   # mass ranked above each token
            slack = math.expm1(tol) if top_p < 1 else 0.0
            strict = (above < top_p - slack) | (above == 0)
            loose = above < top_p + slack
            position = torch.tensor([[len(prompt_ids[i]) + t]])
            g = kn.gumbel(noise_key, position, torch.arange(x.shape[-1]), kn.TARGET)[0, 0]
            score = x + g
            best = float(score[strict].max())
            for run, tok in (("want", a[t]), ("got", b[t])):
                if not (bool(loose[tok]) and float(score[tok]) >= best - tol):
                    problems.append(f"{key} at token {t}: {run}'s {tok} scores {float(score[tok]):.3f} against "
                                    f"the best {best:.3f} (near-tie limit {tol:.3f}; in the loose top-p set: "
                                    f"{bool(loose[tok])})")
    return problems
