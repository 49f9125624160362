"""The small interface every draft exposes to the unified step, and how the registry builds one.

A draft is an `nn.Module` with:
- `aux_layer_ids: tuple[int, ...]`: target layer OUTPUTS it reads (DESIGN.md section 5);
- `num_speculative_tokens: int`: the most tokens it proposes in one call (K_max);
- `new_cache(slots, max_len, dtype, device)`: its own static state (a `Cache`), or None;
- `propose(aux, next_tokens, positions, last_index, cache, attn, pick, k)`: from the target features
  of T entries of every row (entry j: the feature of position p_j and the token at p_j + 1; `attn`
  binds the rows, positions and key bound), absorb the entries into its cache, then propose k tokens
  per row continuing after entry `last_index`. k = 0 absorbs only (a prefill, or a catch-up on the
  positions that plain steps skipped); k is static (one compiled variant per k). `pick` turns draft
  logits over the TARGET vocabulary into tokens (argmax, or a keyed sample plus its probabilities),
  so drafts never know about sampling settings.

Tokens and probabilities always use the target's vocabulary: a draft with a reduced vocabulary maps
its ids before returning. Nothing in `propose` may synchronise with the host. A draft reaches its
target only through the `Target` protocol (embed, final_norm, head), and never opens a file: the
loader (checkpoints/loading.py) hands it tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specgen.errors import CheckpointError
from specgen.models.attention import AttentionBatch
from specgen.models.protocol import TargetShape

# pick(logits [B, V] over the target vocabulary, token positions [B]) -> (tokens [B], probs [B, V] | None)
Pick = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class Draft(Protocol):
    aux_layer_ids: tuple[int, ...]
    num_speculative_tokens: int

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device): ...

    def propose(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                last_index: torch.Tensor, cache, attn: AttentionBatch, pick: Pick,
                k: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def _at_the_root(config: dict) -> str:
    return ""


@dataclass(frozen=True, slots=True)
class DraftBuilder:
    """What the registry needs of a draft method (each draft module defines one as `METHOD`).

    - `config_cls.from_hf(config, target_layers=, target_hidden=, target_vocab=)`, whose result
      has `num_parameters(tensors)` (given the checkpoint's tensor names under the weight prefix)
      and `cache_bytes_per_token(dtype)` (memory estimates);
    - `build(config, state | None, target, *, num_speculative_tokens, dtype, device, seed, where)`:
      the draft module from its HF config and tensors (None = random weights);
    - `dummy_config(shape)`: an HF config in the target's shape, for random-init drafts;
    - `weight_prefix(config)`: where the draft's tensors sit in its checkpoint files."""

    config_cls: type
    build: Callable[..., torch.nn.Module]
    dummy_config: Callable[[TargetShape], dict]
    weight_prefix: Callable[[dict], str] = _at_the_root


@dataclass(frozen=True, slots=True)
class FitCheck:
    name: str          # "vocabulary", "hidden size", "layer ids", "mask token"
    ok: bool
    detail: str        # what was compared, or what is wrong


class TargetFit:
    """How a draft config's `from_hf` checks the draft against its target, one rule at a time. Without
    a `TargetFit` (`fit=None`) the first failed rule raises ValueError (loading); with one, every rule
    is recorded and none raises (inspect-checkpoint lists them as PASS / FAIL)."""

    def __init__(self) -> None:
        self.checks: list[FitCheck] = []

    @staticmethod
    def require(fit: TargetFit | None, name: str, ok: bool, problem: str, detail: str) -> None:
        if fit is None:
            if not ok:
                raise ValueError(problem)
            return
        fit.checks.append(FitCheck(name, ok, detail if ok else problem))


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default capture: the residual entering layers 2, L//2 and L-3, named as outputs."""
    n = num_target_layers
    return (1, n // 2 - 1, n - 4)


def read_draft_config(config_cls, config: dict, target, where: str, name: str) -> Any:
    """The draft's config checked against its target; a bad one is a CheckpointError naming the file."""
    try:
        return config_cls.from_hf(config, target_layers=target.num_layers,
                                  target_hidden=target.hidden_size, target_vocab=target.vocab_size)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}/config.json: not a usable {name} config: {err}") from err
