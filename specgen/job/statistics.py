"""The statistics a job writes: every record in the output, this run's figures, each rank's.

Contract: `job_statistics(...)` -> the dict written to `<output>.stats.json` (counts and acceptance
over every record in the output, a resumed run's included, with vLLM's metric definitions; this
run's throughput, compile time and policy; the memory estimate; notes). `rank_figures` /
`with_ranks` carry each torchrun rank's figures to rank 0 and sum them. `MismatchWatch` reports a
draft whose acceptance length stays at about 1.0 over its first `MISMATCH_DRAFTS` drafts (it is
probably not this target's draft). `output_totals` re-reads an output file's records.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from specgen.job.resolved import Resolved
from specgen.parallel.world import World
from specgen.pipelines.requests import Progress, RunTotals
from specgen.pipelines.runner import Runner
from specgen.pipelines.stats import SpecCounters
from specgen.recipe import Recipe


# A draft that is not random-init, whose mean acceptance length stays below MISMATCH_LENGTH over its
# first MISMATCH_DRAFTS drafts, is probably mismatched (a draft loaded in the wrong mode, or made for
# another target, still matches a common token now and then, so "exactly 1.0" would miss it).
MISMATCH_DRAFTS = 300


MISMATCH_LENGTH = 1.05


def rank_figures(world: World, runner: Runner) -> dict:
    """What one data-parallel copy did this run (rank 0 adds them up in the statistics)."""
    t: RunTotals = runner.totals
    return {"rank": world.rank, "copy": world.dp_rank, "requests": t.requests, "errors": t.errors, "output_tokens": t.output_tokens,
            "steps": t.steps, "prefill_calls": t.prefill_calls, "generation_seconds": t.wall_seconds,
            "compile_seconds": t.compile_seconds, "output_tokens_per_second": t.tokens_per_second,
            "steady_output_tokens_per_second": t.steady_tokens_per_second, "threads": torch.get_num_threads(),
            "k_steps": list(t.k_steps), "header": runner.header}


def with_ranks(stats: dict, ranks: list[dict], world: World) -> dict:
    """Rank 0's statistics with this run's figures summed over every rank. The job's throughput is
    every rank's tokens over the slowest rank's time (what the job took), as a single process's is
    its tokens over its time."""
    tokens = sum(f["output_tokens"] for f in ranks)
    wall = max(f["generation_seconds"] for f in ranks)
    steady = max(f["generation_seconds"] - f["compile_seconds"] for f in ranks)
    k_steps = [0] * max((len(f["k_steps"]) for f in ranks), default=0)
    for f in ranks:
        for k, n in enumerate(f["k_steps"]):
            k_steps[k] += n
    return stats | {
        "this_run": dict(stats["this_run"], requests=sum(f["requests"] for f in ranks),
                         errors=sum(f["errors"] for f in ranks), output_tokens=tokens),
        "steps": sum(f["steps"] for f in ranks),
        "prefill_calls": sum(f["prefill_calls"] for f in ranks),
        "generation_seconds": wall,
        "compile_seconds": max(f["compile_seconds"] for f in ranks),
        "output_tokens_per_second": tokens / wall if wall > 0 else None,
        "steady_output_tokens_per_second": tokens / steady if steady > 0 else None,
        "threads": sum(f["threads"] for f in ranks) * world.tp.size,
        "speculation": dict(stats["speculation"], k_steps=k_steps),
        # a copy of the target per entry: one rank, or the first of a tensor-parallel block
        "data_parallel": {"ranks": len(ranks), "per_rank": ranks} if world.dp_size > 1 else None,
        "tensor_parallel_size": world.tp.size,
    }


class MismatchWatch:
    """Says once when a draft that is not random accepts (almost) nothing over its first drafts."""

    def __init__(self, recipe: Recipe, on_status: Callable[[str], None] | None) -> None:
        # a host draft (suffix) proposes only where text repeats: little acceptance is no mismatch
        self.armed = recipe.draft.has_model and recipe.draft.load_format != "dummy" and \
            recipe.target.load_format != "dummy"
        self.on_status = on_status
        self.notes: list[str] = []

    def __call__(self, p: Progress) -> None:
        spec = p.totals
        if not self.armed or spec.num_drafts < MISMATCH_DRAFTS:
            return
        self.armed = False
        if spec.mean_acceptance_length < MISMATCH_LENGTH:
            note = (f"mean acceptance length {spec.mean_acceptance_length:.3f} over the first {spec.num_drafts} "
                    "drafts: the draft is probably mismatched with this target (made for another model or "
                    "tokenizer, or the wrong draft.method). Output is still exactly the target's.")
            self.notes.append(note)
            if self.on_status is not None:
                self.on_status(f"warning: {note}")


def job_statistics(recipe: Recipe, r: Resolved, seed: int, runner: Runner, complete: bool,
           memory: dict[str, int], notes: list[str], wall: float, out_path: Path, skipped: int) -> dict:
    """Counts and acceptance over every record in the output (a resumed run's earlier ones too);
    throughput, steps and timings of this run (`this_run` says how much of the output it made)."""
    import transformers

    totals: RunTotals = runner.totals
    every = output_totals(out_path, runner.unified.k)
    return {
        "complete": complete,
        "requests": every["requests"],
        "errors": every["errors"],
        "output_tokens": every["output_tokens"],
        "prompt_tokens": every["prompt_tokens"],
        "this_run": {"requests": totals.requests, "errors": totals.errors, "output_tokens": totals.output_tokens,
                     "resumed_past": skipped},
        # records written with another K (a recipe changed between runs); `spec` adds them in
        "spec_records_of_another_k": every["records_of_another_k"],
        "steps": totals.steps,
        "prefill_calls": totals.prefill_calls,
        # prompts the draft did not read, drafting being ruled out when they came (policy.py)
        "unabsorbed_prompts": totals.unabsorbed_prompts,
        "generation_seconds": totals.wall_seconds,
        "compile_seconds": totals.compile_seconds,
        "wall_seconds": wall,
        "output_tokens_per_second": totals.tokens_per_second,
        "steady_output_tokens_per_second": totals.steady_tokens_per_second,
        "compiled": runner.compiled,
        "threads": torch.get_num_threads(),
        "header": runner.header,
        "spec": every["spec"].to_dict(),
        # how this run chose k: steps per k (0 = plain), and the adaptive policy's estimates
        "speculation": {"k_steps": totals.k_steps, **runner.policy.summary()},
        # structured output: the host's share of a step (reading the drafts, the grammar's masks)
        "structured": {"mask_ms_per_step": 1000 * totals.mask_seconds / max(1, totals.steps),
                       "step_ms": 1000 * totals.step_seconds / max(1, totals.steps),
                       # drafts the grammar wrote in place of refused ones (draft.jump_forward), and
                       # slot-steps whose drafts stopped at a refused one it could not replace
                       "grammar_draft_tokens": totals.grammar_drafts,
                       "refused_draft_steps": totals.refused_drafts}
        if runner.grammar is not None else None,
        "seed": seed,
        "recipe": recipe.to_dict(),
        "notes": notes,
        "memory_estimate_bytes": memory,
        "device": device_name(r.device),
        "dtype": str(runner.resolved.dtype).removeprefix("torch."),
        "draft_dtype": str(runner.resolved.draft_dtype).removeprefix("torch.") if recipe.draft.has_model else None,
        "versions": {"specgen": specgen_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
    }


def output_totals(path: Path, k: int) -> dict:
    """Requests, errors, tokens and acceptance counters summed over the records of an output file."""
    out = {"requests": 0, "errors": 0, "output_tokens": 0, "prompt_tokens": 0, "spec": SpecCounters(k),
           "records_of_another_k": 0}
    if not path.exists():
        return out
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
                out["requests"] += 1
                out["errors"] += record.get("finish_reason") == "error"
                out["output_tokens"] += int(record.get("num_output_tokens") or 0)
                out["prompt_tokens"] += int(record.get("num_prompt_tokens") or 0)
                spec = record.get("spec")
                if spec is None:
                    continue
                counters = SpecCounters.from_dict(spec)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue       # a torn last line of a killed run (cut on resume), or a foreign line
            # a record written with another K (a changed recipe) adds in: per-position counts say
            # how many drafts reached each position
            out["records_of_another_k"] += counters.num_speculative_tokens != k
            out["spec"].merge(counters)
    return out


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def specgen_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specgen")
    except PackageNotFoundError:
        return "unknown"
