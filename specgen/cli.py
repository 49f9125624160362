"""The `specgen` command line. Each command parses its options and calls ONE library function."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from specgen.recipe import RecipeError, load_recipe

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Offline batch generation with lossless speculative decoding.")
console = Console(stderr=True)


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
    """Generate a completion for every prompt; resumable, one JSONL line per prompt."""
    try:
        parsed = load_recipe(recipe, set_ or ())
    except RecipeError as err:
        console.print(f"[red]{err}[/red]", markup=True, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    from specgen.job import JobError, run_job  # heavy imports only once the recipe is valid

    out = Path(output or parsed.output)
    bar = _progress_bar()
    task = None

    def on_start(total: int, header: str, notes: list[str]) -> None:
        nonlocal task
        console.print(f"specgen: {header}", highlight=False, soft_wrap=True)
        for note in notes:
            console.print(f"[yellow]note:[/yellow] {note}", highlight=False, soft_wrap=True)
        bar.start()
        task = bar.add_task("generating", total=total, rate="-", accept="-")

    def on_progress(p) -> None:
        mal = p.totals.mean_acceptance_length
        bar.update(task, completed=p.finished, rate=f"{p.tokens_per_second:,.1f} tok/s",
                   accept=f"accept len {mal:.2f}" if mal is not None else "no draft")

    def on_status(line: str) -> None:
        bar.console.print(line, highlight=False)

    try:
        summary = run_job(parsed, prompts=prompts, output=output, limit=limit, resume=not no_resume,
                          on_start=on_start, on_progress=on_progress, on_status=on_status)
    except JobError as err:
        bar.stop()
        console.print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        bar.stop()
        console.print(f"\n[yellow]interrupted.[/yellow] Finished results are safe in {out}; run the same "
                      "command again to resume (ids already written are skipped).", highlight=False)
        raise typer.Exit(130) from None
    bar.stop()
    _print_summary(summary)


def _progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[accept]}"),
                    TimeElapsedColumn(), console=console, transient=False)


def _print_summary(summary) -> None:
    s = summary.stats
    if summary.skipped:
        console.print(f"resumed: {summary.skipped} prompts were already done in {summary.output}")
    rate = s["output_tokens_per_second"]
    line = (f"{s['requests']} prompts ({s['errors']} errors), {s['output_tokens']} tokens in "
            f"{s['generation_seconds']:.1f} s = {rate or 0:,.1f} tok/s")
    if s["compile_seconds"]:
        line += (f" (compiling took {s['compile_seconds']:.1f} s; "
                 f"{s['steady_output_tokens_per_second'] or 0:,.1f} tok/s without it)")
    spec = s["spec"]
    if spec["mean_acceptance_length"] is not None:
        line += (f"; mean acceptance length {spec['mean_acceptance_length']:.2f}, "
                 f"draft acceptance rate {spec['draft_acceptance_rate']:.1%}")
    console.print(line, highlight=False)
    console.print(f"results: {summary.output}\nstats:   {summary.stats_file}", highlight=False, soft_wrap=True)


if __name__ == "__main__":
    app()
