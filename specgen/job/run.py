"""`specgen run` as a library call: a validated recipe in, results JSONL + stats JSON out.

Contract: `run_job(recipe, ...)` resolves the device and checkpoints (job/resolved.py), checks that
the run fits in memory BEFORE any weights load (job/memory.py), skips ids already in the output
(resume), builds the runner (job/build.py), streams one result line per prompt as it finishes
(errors are records, never crashes), and writes `<output>.stats.json` at the end (also after
Ctrl-C, for what finished: job/statistics.py). Under torchrun each rank takes its shard of the
prompts (parallel/shards.py), writes its part, and rank 0 merges them. Raises `JobError` for
problems with the run as a whole, and its `InputError` for bad input. Returns a `JobSummary`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specgen.checkpoints.store import CheckpointError
from specgen.data import (
    PromptRecord, PromptSourceError, ResultWriter, read_prompts, stats_path, tokenize_with_generation_start,
    write_json_atomic)
from specgen.job.build import build_runner
from specgen.job.errors import InputError
from specgen.job.memory import check_memory
from specgen.job.resolved import Resolved, check_output, resolve
from specgen.job.statistics import MismatchWatch, job_statistics, rank_figures, with_ranks
from specgen.parallel.decisions import SharedDecisions
from specgen.parallel.progress import JobProgress
from specgen.parallel.shards import finished_ids, merge_parts, part_path, remove_parts, shard_of
from specgen.parallel.world import World
from specgen.pipelines.hybrid_policy import HybridPolicy
from specgen.pipelines.policy import FixedPolicy
from specgen.pipelines.requests import Completion, Progress, Request
from specgen.pipelines.stats import SpecCounters
from specgen.recipe import Recipe
from specgen.structured.formats import ResponseFormat


@dataclass(slots=True)
class JobSummary:
    output: Path
    stats_file: Path
    stats: dict
    skipped: int
    notes: list[str]


def request_key(request_id: str) -> int:
    """A request's noise stream comes from its id, so a resumed run reproduces it."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


def expected_tokens(records: list[PromptRecord], recipe: Recipe) -> int:
    """Output tokens a job produces at most (every prompt to its max_tokens)."""
    return sum(r.max_tokens or recipe.sampling.max_tokens for r in records if not r.error)


def expected_steps(records: list[PromptRecord], recipe: Recipe) -> int:
    """Decode steps a job takes at most (every prompt to its max_tokens, one token per step)."""
    return -(-expected_tokens(records, recipe) // recipe.runtime.batch_size)


def response_format_of(record: PromptRecord, recipe: Recipe) -> ResponseFormat | None:
    """The constraint a prompt's output takes: the line's own, else the recipe's (None: none)."""
    fmt = record.response_format or recipe.sampling.response_format
    return fmt if fmt is not None and fmt.constrains else None


def job_requests(records: list[PromptRecord], tokenizer, recipe: Recipe) -> Iterator[Request]:
    for record in records:
        max_tokens = record.max_tokens or recipe.sampling.max_tokens
        if record.error:
            yield Request(record.id, [], max_tokens, 0, error=record.error)
            continue
        try:
            ids, start = tokenize_with_generation_start(
                record, tokenizer, recipe.chat_template and tokenizer.chat_template is not None,
                recipe.chat_template_kwargs)
        except Exception as err:  # a prompt the tokenizer rejects is that prompt's error only
            yield Request(record.id, [], max_tokens, 0, error=f"tokenisation failed: {err}")
            continue
        yield Request(record.id, ids, max_tokens, request_key(record.id), generation_start=start,
                      response_format=response_format_of(record, recipe))


def result_record(c: Completion) -> dict:
    return {
        "id": c.id, "text": c.text, "reasoning_text": c.reasoning_text, "token_ids": c.token_ids,
        "num_prompt_tokens": c.num_prompt_tokens, "num_output_tokens": len(c.token_ids),
        "num_reasoning_tokens": c.num_reasoning_tokens, "finish_reason": c.finish_reason, "error": c.error,
        "spec": c.spec.to_dict() if c.spec is not None else None,
        "logprobs": c.logprobs,
        "prompt_logprobs": c.prompt_logprobs,
    }


def run_job(recipe: Recipe, *, prompts: str | None = None, output: str | None = None,
            limit: int | None = None, resume: bool = True,
            on_start: Callable[[int, str, list[str]], None] | None = None,
            on_progress: Callable[[Progress], None] | None = None,
            on_status: Callable[[str], None] | None = None,
            world: World | None = None) -> JobSummary:
    """Run a recipe end to end. `on_start(total, header, notes)` fires once the models are loaded;
    `on_status(line)` reports the one-time warm-up.

    Under torchrun (`world`, default: from the environment) each rank takes the prompts whose ids
    hash to it (parallel/shards.py) and writes its own part; rank 0's `on_start` and `on_progress`
    count every rank's prompts, and rank 0 merges the parts and writes the statistics once every rank
    is done. The other ranks return their own figures and write no statistics."""
    started = time.perf_counter()
    world = World.from_env() if world is None else world
    try:
        world.check_tensor_parallel(recipe.runtime.tensor_parallel_size)
    except ValueError as err:
        raise InputError(str(err)) from None
    out_path = Path(output or recipe.output)
    check_output(out_path)
    check_output(stats_path(out_path))
    try:
        records = list(read_prompts(prompts or recipe.prompts, limit=limit))
    except PromptSourceError as err:
        raise InputError(str(err)) from err
    if world.distributed and torch.cuda.is_available() and recipe.runtime.device != "cpu":
        torch.cuda.set_device(world.local_rank)    # before anything asks CUDA (memory, contexts)
    r = resolve(recipe)
    memory = check_memory(recipe, r, ranks_here=world.local_size)
    joined_here = world.distributed and world.host_group is None
    world.start(r.device, recipe.runtime.tensor_parallel_size, recipe.runtime.expert_parallel)
    clean = False
    try:
        summary = _run_shard(recipe, r, world, records, out_path, memory, resume, started,
                             on_start, on_progress, on_status)
        clean = True
        return summary
    finally:
        if joined_here:
            world.stop(clean)


def _run_shard(recipe: Recipe, r: Resolved, world: World, records: list[PromptRecord], out_path: Path,
               memory: dict[str, int], resume: bool, started: float, on_start, on_progress,
               on_status) -> JobSummary:
    """`run_job` once the process group (if any) is joined: this rank's prompts, then the merge."""
    seed = recipe.sampling.seed if recipe.sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
    seed = world.from_leader(seed)       # one job, one seed: the noise of an id is the same on any rank
    threads = world.cpu_share()
    if not resume and world.leader:
        remove_parts(out_path, from_rank=world.dp_size)   # an earlier run's; each copy empties its own
    done = finished_ids(out_path) if resume else set()  # also what any number of ranks wrote before
    done = world.from_tp_leader(done)    # a copy's ranks run one loop: the same prompts, whatever they read
    todo_everywhere = [rec for rec in records if rec.id not in done]
    # a copy of the target (one rank, or a block of tensor-parallel ranks) takes the ids hashed to it
    todo = [rec for rec in todo_everywhere if shard_of(rec.id, world.dp_size) == world.dp_rank]
    skipped = len(records) - len(todo_everywhere)
    shared = JobProgress(world) if world.distributed else None
    with (ResultWriter(part_path(out_path, world.dp_rank), resume=resume) if world.writes else _Discard()) as writer:
        try:
            runner, tokenizer, notes = build_runner(
                recipe, r, seed, expected_steps=expected_steps(todo, recipe),
                expected_tokens=expected_tokens(todo, recipe), threads=threads, tp=world.tp,
                structured=any(response_format_of(rec, recipe) is not None for rec in todo if not rec.error))
        except CheckpointError as err:     # the tokenizer, or weights that changed since the check
            raise InputError(str(err)) from err
        if world.tp.active:
            runner.header += f", tensor parallel: rank {world.tp.rank} of {world.tp.size}"
            if not isinstance(runner.policy, FixedPolicy):   # one k for the copy's ranks
                if isinstance(runner.policy, HybridPolicy) and not isinstance(runner.policy.model, FixedPolicy):
                    runner.policy.model = SharedDecisions(runner.policy.model, world)
                runner.policy = SharedDecisions(runner.policy, world)
        if world.dp_size > 1:
            runner.header += (f", data parallel: copy {world.dp_rank} of {world.dp_size} "
                              f"({len(todo)} of {len(todo_everywhere)} prompts)")
        if recipe.chat_template and tokenizer.chat_template is None:
            notes.append("the tokenizer has no chat template: prompts are used as plain text")
        if on_start is not None:
            on_start(len(todo_everywhere) if world.leader else len(todo), runner.header, notes)
        watch = MismatchWatch(recipe, on_status)
        latest = Progress(0, 0, 0.0, SpecCounters(runner.unified.k))

        def on_finish(c: Completion) -> None:
            writer.write(result_record(c))

        def progress(p: Progress) -> None:
            nonlocal latest
            latest = p
            watch(p)
            if shared is not None and world.writes:
                shared.update(p)
            if on_progress is not None:
                on_progress(shared.combined(p) if shared is not None and world.leader else p)

        complete = False
        ranks: list[dict] | None = None
        try:
            runner.run(job_requests(todo, tokenizer, recipe), on_finish, progress, on_status)
            if shared is not None:
                writer.sync()       # on disk before rank 0 may read it (a shared filesystem too)
                shared.finish(rank_figures(world, runner) if world.writes else {})
                show = (lambda: on_progress(shared.combined(latest))) if on_progress and world.leader else None
                ranks = shared.wait_all(show)
            complete = True
        finally:
            notes += watch.notes
            if world.leader:
                writer.close()
                if complete:
                    merge_parts(out_path, [rec.id for rec in records])
                # Written after Ctrl-C too: the figures then cover the requests that finished
                # (under data parallel, those in the output: the parts merge on the next run).
                stats = job_statistics(recipe, r, seed, runner, complete, memory, notes,
                               time.perf_counter() - started, out_path, skipped)
                if ranks is not None:
                    stats = with_ranks(stats, [f for f in ranks if f], world)
                write_json_atomic(stats_path(out_path), stats)
            else:
                stats = {"complete": complete, "data_parallel_rank": rank_figures(world, runner)}
            runner.close()
    return JobSummary(out_path, stats_path(out_path), stats, skipped, notes)


class _Discard:
    """The results writer of a tensor-parallel rank that is not its copy's first: the first writes."""

    def write(self, record) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Discard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass
