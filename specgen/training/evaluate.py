"""How good a trained draft is, measured two ways.

- `heldout_agreement(draft, ...)`: while training, the top-1 agreement of each drafted position with
  the target's own answer on held-out sequences (teacher-forced: cheap, no generation).
- `measure_acceptance(recipe, folder, ks, ...)`: after export, the real thing: `specgen run` (greedy)
  on held-out prompts with the exported checkpoint at each K, plus one plain run, giving the mean
  acceptance length (vLLM's definition: 1 + accepted / drafts) and tokens/s per K. The draft's best
  K is the fastest one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specgen.training.features import padded_batch, target_features


@torch.no_grad()
def heldout_agreement(draft, target, trainer, sequences: list[tuple[list[int], int]], spec, *,
                      autocast: torch.dtype | None, batch_size: int, features=None) -> list[float]:
    """Per drafted position: top-1 agreement with the target's answer on held-out sequences.
    `features(batch, tokens)`: their target features from a store (train.feature_cache), else live."""
    correct = count = None
    generator = torch.Generator().manual_seed(12345)        # same anchors every time: comparable
    for start in range(0, len(sequences), batch_size):
        device = target.input_embedding.device
        batch = sequences[start:start + batch_size]
        tokens, scored = (t.to(device) for t in padded_batch(batch))
        aux = features(batch, tokens) if features is not None else target_features(target, tokens, draft.aux_layer_ids)
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            _, c, n = trainer.loss(draft, aux, tokens, scored, spec, generator)
        correct = c.double() if correct is None else correct + c.double()
        count = n.double() if count is None else count + n.double()
    return (correct / count.clamp(min=1)).tolist()


@dataclass(frozen=True, slots=True)
class KResult:
    k: int | None                         # None = plain decoding
    mean_acceptance_length: float | None
    tokens_per_second: float
    output_tokens: int


def measure_acceptance(recipe_data: dict, folder: Path, ks: list[int], prompts: Path, work: Path, *,
                       on_status: Callable[[str], None] | None = None, label: str = "held-out") -> list[KResult]:
    """`specgen run` with the draft in `folder` at each K, and once without a draft, on `prompts`."""
    from specgen.job import run_job
    from specgen.recipe import recipe_from_dict

    results = []
    for k in [None, *ks]:
        data = json.loads(json.dumps(recipe_data))
        data.pop("train", None)
        if k is None:
            data["draft"] = {"method": "none"}
        else:
            data["draft"].update({"model": str(folder), "load_format": "auto", "num_speculative_tokens": k})
            data["draft"].pop("max_speculative_tokens", None)     # a pinned K has no maximum
        data["prompts"] = str(prompts)
        out = work / f"eval-{'ar' if k is None else f'k{k}'}.jsonl"
        data["output"] = str(out)
        if on_status is not None:
            on_status(f"measuring {label} acceptance: {'no draft' if k is None else f'K = {k}'}")
        summary = run_job(recipe_from_dict(data), resume=False)
        s = summary.stats
        results.append(KResult(k, s["spec"]["mean_acceptance_length"],
                               s["steady_output_tokens_per_second"] or s["output_tokens_per_second"] or 0.0,
                               s["output_tokens"]))
    return results
