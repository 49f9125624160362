"""The `specgen` command line. Each command parses its options and calls ONE library function."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specgen.recipe import RecipeError, load_recipe

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch generation with lossless speculative decoding.")
console = Console(stderr=True)

# Exit codes of `specgen run` (docs/exit-codes.md): 0 every record generated; 1 the run failed (e.g. memory);
# 2 bad input (recipe, checkpoint, output path, prompt source); 3 the run finished but some records
# are errors (a bad prompt line, a prompt too long); 130 interrupted (resumable).
EXIT_ERROR_RECORDS = 3


@app.callback()
def main() -> None:
    """Offline batch generation with lossless speculative decoding."""


@app.command()
def run(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML (see recipes/).")],
    prompts: Annotated[str | None, typer.Option(help="Prompts: 'default', 'sharegpt' or a .jsonl file.")] = None,
    output: Annotated[str | None, typer.Option(help="Results JSONL (stats go to <output>.stats.json).")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Use only the first N prompts.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe field: a.b=value (YAML).")] = None,
    no_resume: Annotated[bool, typer.Option("--no-resume", help="Start over instead of skipping ids already written.")] = False,
) -> None:
    """Generate a completion for every prompt; resumable, one JSONL line per prompt.
    Exit 0: all generated; 1: failed; 2: bad input (recipe, checkpoint, output path, prompts);
    3: finished with error records; 130: interrupted (rerun to resume).
    Under `torchrun --nproc-per-node N -m specgen run ...` the prompts are shared out over the ranks
    (data parallel); rank 0 shows the progress of all of them and merges their results."""
    try:
        parsed = load_recipe(recipe, set_ or ())
    except RecipeError as err:
        console.print(f"[red]{err}[/red]", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    from specgen.job import JobError, run_job  # heavy imports only once the recipe is valid
    from specgen.parallel.world import World, leave_process

    try:
        world = World.from_env()
    except (ValueError, KeyError) as err:
        console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    out = Path(output or parsed.output)
    bar = _progress_bar()
    task = None

    def on_start(total: int, header: str, notes: list[str]) -> None:
        nonlocal task
        if not world.leader:        # one bar and one set of notes for the job: rank 0's
            console.print(f"specgen rank {world.rank}: {header}", highlight=False, soft_wrap=True)
            return
        console.print(f"specgen: {header}", highlight=False, soft_wrap=True)
        for note in notes:
            console.print(f"[yellow]note:[/yellow] {note}", highlight=False, soft_wrap=True)
        bar.start()
        task = bar.add_task("generating", total=total, rate="-", accept="-")

    def on_progress(p) -> None:
        if task is not None:
            bar.update(task, completed=p.finished, rate=f"{p.tokens_per_second:,.1f} tok/s",
                       accept=_acceptance_field(p.totals))

    def on_status(line: str) -> None:
        bar.console.print(line if world.leader else f"rank {world.rank}: {line}", highlight=False)

    try:
        with _stopping_cleanly(bar, JobError, f"Finished results are safe in {out}; run the same command "
                                              "again to resume (ids already written are skipped)."):
            summary = run_job(parsed, prompts=prompts, output=output, limit=limit, resume=not no_resume,
                              on_start=on_start, on_progress=on_progress, on_status=on_status, world=world)
    except typer.Exit as done:
        if world.distributed:           # a rank leaves without finalizing (parallel/world.leave_process)
            leave_process(done.exit_code)
        raise
    if not world.leader:
        if world.distributed:
            leave_process(0)
        return
    _print_summary(summary)
    if summary.stats["errors"]:
        # Under torchrun any rank's non-zero exit reads as the job's failure (torchrun exits 1 with a
        # traceback), which a finished job is not: there the records and the stats say it.
        code = 0 if world.distributed else EXIT_ERROR_RECORDS
        console.print(f"[yellow]{summary.stats['errors']} of {summary.stats['requests']} records are errors "
                      f"(finish_reason \"error\"): exit code {code}[/yellow]", highlight=False)
        if not world.distributed:
            raise typer.Exit(code)
    if world.distributed:
        leave_process(0)


@contextmanager
def _stopping_cleanly(bar: Progress, expected: type[Exception], resume_hint: str):
    """Around a long command: the bar always stops; an `expected` error prints as one line (exit 2
    when it is an input error, else 1), Ctrl-C as the hint to resume (exit 130). Anything else is a
    bug and keeps its traceback."""
    try:
        yield
    except expected as err:
        bar.stop()
        console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2 if getattr(err, "exit_code", 1) == 2 else 1) from None
    except KeyboardInterrupt:
        bar.stop()
        console.print(f"\n[yellow]interrupted.[/yellow] {resume_hint}", highlight=False, soft_wrap=True)
        raise typer.Exit(130) from None
    bar.stop()


@app.command("train-draft")
def train_draft(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML with a train section (see recipes/).")],
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a recipe field: a.b=value (YAML).")] = None,
    restart: Annotated[bool, typer.Option("--restart", help="Ignore the checkpoint of an interrupted run.")] = False,
) -> None:
    """Train the recipe's draft on the target's own answers; writes it to draft.model with a card."""
    try:
        parsed = load_recipe(recipe, set_ or ())
        if not parsed.draft.has_model:
            raise RecipeError("draft.method", f"{parsed.draft.method}: train-draft needs a draft model to train "
                                              "(eagle3, dflash or mtp)")
        if parsed.train is None:
            raise RecipeError("train", "required by train-draft (see recipes/smollm2-eagle3.yaml)")
    except RecipeError as err:
        console.print(f"[red]{err}[/red]", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    from specgen.training.trainer import TrainError, train_draft as run_training

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console)
    tasks: dict[str, int] = {}

    def on_data(split: str, p, total: int) -> None:
        if split not in tasks:
            bar.start()
            tasks[split] = bar.add_task(f"{split} answers", total=total, info="")
        bar.update(tasks[split], completed=p.finished, info=f"{p.tokens_per_second:,.1f} tok/s")

    def on_progress(p) -> None:
        if "train" not in tasks:
            bar.start()
            tasks["train"] = bar.add_task("training", total=p.total_steps, info="")
        agree = f", held-out top-1 {p.agreement[0]:.1%}" if p.agreement else ""
        bar.update(tasks["train"], completed=p.step,
                   info=f"loss {p.loss:.3f}, {p.tokens_per_second:,.0f} tok/s{agree}")

    def on_status(line: str) -> None:
        bar.console.print(line, highlight=False, soft_wrap=True)

    with _stopping_cleanly(bar, TrainError, "The last checkpoint is kept; run the same command again to resume."):
        summary = run_training(parsed, restart=restart, on_status=on_status, on_progress=on_progress,
                               on_data_progress=on_data)
    best = [r for r in summary.acceptance if r.k is not None]
    line = f"trained {summary.steps} steps ({summary.tokens_seen:,} tokens) in {summary.train_seconds / 60:.1f} min"
    if best:
        line += "; held-out mean acceptance length " + ", ".join(
            f"K={r.k}: {r.mean_acceptance_length:.2f}" for r in best)
    console.print(line, highlight=False)
    console.print(f"draft: {summary.output} (card: {summary.output / 'README.md'})", highlight=False,
                  soft_wrap=True)


@app.command("inspect-checkpoint")
def inspect_checkpoint(
    path: Annotated[str, typer.Argument(help="A checkpoint folder, a .gguf file or an alias.")],
    target: Annotated[str | None, typer.Option(help="A target checkpoint: check this draft against it.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
    batch_size: Annotated[int, typer.Option(min=1, help="Batch size for the memory figures.")] = 1,
    max_seq_len: Annotated[int, typer.Option(min=1, help="Tokens per sequence for the memory figures.")] = 4096,
    tensor_parallel: Annotated[int, typer.Option(min=1, help="Also give one rank's memory when N ranks split "
                                                             "the target (runtime.tensor_parallel_size).")] = 1,
    expert_parallel: Annotated[bool, typer.Option("--expert-parallel", help="With --tensor-parallel: whole "
                                                  "routed experts per rank (runtime.expert_parallel).")] = False,
) -> None:
    """What a checkpoint holds and whether specgen can run it, from headers only (no weights read).
    Exit 0: runnable; 1: not runnable (reasons listed); 2: unreadable input."""
    from specgen.inspection.identify import Unreadable
    from specgen.inspection.render import render, to_json, unreadable_json
    from specgen.inspection.report import inspect_checkpoint as inspect

    try:
        report = inspect(path, target, batch_size=batch_size, max_seq_len=max_seq_len,
                         tensor_parallel=tensor_parallel, expert_parallel=expert_parallel)
    except Unreadable as err:
        if json_:
            print(unreadable_json(path, err))
        else:
            console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if json_:
        print(to_json(report))
    else:
        render(report, Console(width=max(Console().width, 120)))
    raise typer.Exit(0 if report.runnable else 1)


@app.command()
def bench(
    recipes: Annotated[list[Path], typer.Argument(help="One or more recipes of the same target.")],
    prompts: Annotated[str | None, typer.Option(help="Prompts: 'default', 'sharegpt-heldout' or a .jsonl file "
                                                     "(default: held-out ShareGPT when installed).")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Prompts used.")] = 16,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8",
    max_tokens: Annotated[int, typer.Option(min=1, help="Max new tokens per prompt (greedy, to EOS).")] = 128,
    baselines: Annotated[str, typer.Option(help="Comma-separated: ar (no draft), hf (transformers generate), "
                                                     "llamacpp (llama.cpp on the same GGUF: the llamacpp extra).")] = "ar,hf",
    repeats: Annotated[int, typer.Option(min=1, help=(
        "Rounds of timed runs: each runs every configuration on every prompt, leg by leg (--chunk), "
        "each leg in the order opposite to the leg before."))] = 2,
    chunk: Annotated[int | None, typer.Option(min=1, help=(
        "Prompts per leg: a round runs every configuration on one leg of prompts before the next, so "
        "compared runs lie seconds apart (default: max(batch size, 4)); speed-ups pair legs."))] = None,
    ks: Annotated[str, typer.Option(help="Comma-separated K settings to run each recipe with beside its own, "
                                         "e.g. 1,2,3,auto (auto: chosen per step).")] = "",
    output: Annotated[Path | None, typer.Option(help="JSON report (default: outputs/bench-<recipe>.json).")] = None,
    plot: Annotated[Path | None, typer.Option(help="PNG (default: next to the JSON report).")] = None,
    all_drafts: Annotated[bool, typer.Option("--all-drafts", help="Add every recipe beside the first that "
                                                                   "drafts for the same target.")] = False,
    split: Annotated[bool, typer.Option(help="Time split of a step per phase (an eager twin of each "
                                             "configuration, after the timed runs).")] = True,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a field of every recipe: a.b=value.")] = None,
    response_format: Annotated[Path | None, typer.Option(help=(
        "A JSON or YAML file holding a response_format ({type: json_schema, schema: ...}, regex, choice, "
        "grammar): every configuration runs again with its outputs under it, beside ar under it."))] = None,
    markdown: Annotated[Path | None, typer.Option(help=(
        "Also write the results as a Markdown table with the command, commit, CPU and date "
        "(what docs/performance.md holds)."))] = None,
) -> None:
    """Speed-up of speculative decoding over plain decoding and transformers, on the same prompts."""
    import shlex
    import sys

    try:
        sizes = tuple(int(x) for x in batch_sizes.split(","))
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        console.print(f"[red]--batch-sizes: expected comma-separated integers >= 1, got {batch_sizes!r}[/red]")
        raise typer.Exit(2) from None
    try:
        extra_ks = tuple("auto" if k.strip() == "auto" else int(k) for k in ks.split(",") if k.strip())
        if any(k != "auto" and not 1 <= k <= 32 for k in extra_ks):
            raise ValueError
    except ValueError:
        console.print(f"[red]--ks: expected comma-separated integers in 1..32 or auto, got {ks!r}[/red]")
        raise typer.Exit(2) from None
    chosen = tuple(b for b in baselines.split(",") if b)
    if set(chosen) - {"ar", "hf", "llamacpp"}:
        console.print(f"[red]--baselines: expected ar, hf and/or llamacpp, got {baselines!r}[/red]")
        raise typer.Exit(2) from None
    paths = list(recipes)
    if all_drafts:
        paths += _sibling_draft_recipes(paths[0], paths)
    try:
        parsed = [load_recipe(p, set_ or ()) for p in paths]
    except RecipeError as err:
        console.print(f"[red]{err}[/red]", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    from specgen.bench.measure import BenchError, BenchOptions, run_bench
    from specgen.bench.report import table, write_json, write_png

    fmt = None
    if response_format is not None:
        try:
            fmt = read_response_format(response_format)
        except ValueError as err:
            console.print(f"[red]--response-format: {err}[/red]", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
    options = BenchOptions(prompts, limit, sizes, max_tokens, chosen, repeats, extra_ks, split, chunk, fmt)
    out = output or Path("outputs") / f"bench-{paths[0].stem}.json"
    png = plot or out.with_suffix(".png")
    try:
        report = run_bench(parsed, options, on_status=lambda line: console.print(line, highlight=False))
    except BenchError as err:
        console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(err.exit_code) from None
    # Wide enough for every column whatever the terminal: a narrow one wraps lines, never cuts figures.
    wide = Console(width=max(Console().width, 180))
    wide.print(table(report))
    data = write_json(report, out, " ".join(shlex.quote(a) for a in ["specgen", *sys.argv[1:]]))
    write_png(report, png)
    console.print(f"report: {out}\nplot:   {png}", highlight=False, soft_wrap=True)
    if markdown is not None:
        from specgen.bench.markdown import markdown as as_markdown

        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(as_markdown(data))
        console.print(f"table:  {markdown}", highlight=False, soft_wrap=True)
    failures = [m for m in report.measurements if m.error and not m.skipped]
    skipped = [m for m in report.measurements if m.skipped]
    total = len(report.measurements)
    if failures:
        console.print(f"[red]{len(failures)} of {total} measurements failed[/red]", highlight=False)
    if skipped:
        console.print(f"[red]{len(skipped)} of {total} measurements skipped: they would not fit in memory "
                      f"beside the others[/red]", highlight=False)
    if failures or skipped:  # the others' figures are written; the exit status says the bench is incomplete
        raise typer.Exit(1)


def read_response_format(path: Path):
    """A response_format from a JSON or YAML file (ValueError naming the file and field)."""
    import yaml

    from specgen.structured.formats import parse_response_format

    try:
        value = yaml.safe_load(path.read_text())      # JSON is YAML
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"{path}: cannot read it ({err})") from None
    return parse_response_format(value, str(path))


def _sibling_draft_recipes(first: Path, given: list[Path]) -> list[Path]:
    """Recipes beside `first` with the same target and another draft method (for --all-drafts)."""
    import yaml

    def read(p: Path) -> dict:
        try:
            data = yaml.safe_load(p.read_text())
        except (OSError, yaml.YAMLError):
            return {}
        return data if isinstance(data, dict) else {}

    mine = read(first)
    target = (mine.get("target") or {}).get("model")
    methods = {((read(p).get("draft") or {}).get("method")) for p in given}
    found = []
    for p in sorted(first.parent.glob("*.yaml")):
        data = read(p)
        method = (data.get("draft") or {}).get("method")
        if p not in given and (data.get("target") or {}).get("model") == target and method not in (None, "none") \
                and method not in methods and (data.get("draft") or {}).get("load_format") != "dummy":
            found.append(p)
            methods.add(method)
    return found


def _progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[accept]}"),
                    TimeElapsedColumn(), console=console, transient=False)


def _acceptance_field(totals) -> str:
    """The progress bar's acceptance: length, and the mean k drafted per step when k adapts."""
    steps = sum(totals.k_histogram)
    mean_k = sum(k * n for k, n in enumerate(totals.k_histogram)) / steps if steps else None
    mal = totals.mean_acceptance_length
    if mal is None:
        return "plain steps (k = 0)" if steps else "no draft"
    text = f"accept len {mal:.2f}"
    return text + f", mean k {mean_k:.1f}" if mean_k is not None else text


def _k_shares(histogram: list[int]) -> str:
    steps = sum(histogram)
    return ", ".join(f"k={k} {n / steps:.0%}" for k, n in enumerate(histogram) if n) if steps else ""


def _print_summary(summary) -> None:
    s = summary.stats
    if summary.skipped:
        console.print(f"resumed: {summary.skipped} prompts were already done in {summary.output}")
    rate, this = s["output_tokens_per_second"], s["this_run"]
    line = (f"{this['requests']} prompts ({this['errors']} errors), {this['output_tokens']} tokens in "
            f"{s['generation_seconds']:.1f} s = {rate or 0:,.1f} tok/s")
    if s.get("data_parallel"):
        line += f" over {s['data_parallel']['ranks']} data-parallel ranks"
    if (s.get("tensor_parallel_size") or 1) > 1:
        line += f" (the target split over {s['tensor_parallel_size']} tensor-parallel ranks)"
    if this["resumed_past"]:
        line = (f"{s['requests']} prompts in the output ({s['errors']} errors); this run: " + line)
    if s["compile_seconds"]:
        line += (f" (compiling took {s['compile_seconds']:.1f} s; "
                 f"{s['steady_output_tokens_per_second'] or 0:,.1f} tok/s without it)")
    spec = s["spec"]
    if spec["mean_acceptance_length"] is not None:
        line += (f"; mean acceptance length {spec['mean_acceptance_length']:.2f}, "
                 f"draft acceptance rate {spec['draft_acceptance_rate']:.1%}")
        if spec["num_relaxed_accepted_tokens"]:
            line += f" ({spec['num_relaxed_accepted_tokens']} tokens accepted only by relaxed acceptance: lossy)"
    if s["speculation"].get("policy") == "auto" and spec.get("k_histogram"):
        line += f"; steps by k: {_k_shares(spec['k_histogram'])}"
    console.print(line, highlight=False)
    console.print(f"results: {summary.output}\nstats:   {summary.stats_file}", highlight=False, soft_wrap=True)


if __name__ == "__main__":
    app()
