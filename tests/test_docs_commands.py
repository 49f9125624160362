"""Every `specgen ...` command the README and docs/ show still parses, and its recipe still loads.

A renamed flag, a removed option or a recipe field that no longer exists fails here, not in a user's
shell. Each command in a fenced code block (`.venv/bin/specgen ...`, `specgen ...`, `torchrun ... -m
specgen ...`, with backslash continuations) is parsed by the CLI's own click command without running
it; a recipe it names under recipes/ is loaded with the command's `--set` overrides (the recipe
validation `specgen run` does before anything loads). Recipes a page names as a stand-in for the
reader's own (not under recipes/) are parsed for their flags only.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from specgen.cli import app
from specgen.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
RECIPE_ARGS = {"run": 1, "bench": None, "train-draft": 1}    # leading recipe paths (None: all of them)


def commands(page: Path) -> list[tuple[int, list[str]]]:
    """(line, the arguments after `specgen`) of each specgen command in the page's code blocks."""
    text = page.read_text()
    found = []
    for block in FENCE.finditer(text):
        first = text[:block.start()].count("\n") + 2
        joined = re.sub(r"\\\n\s*", " ", block.group(1))
        for offset, line in enumerate(joined.splitlines()):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            lead = next((i for i, word in enumerate(words) if not re.match(r"^\w+=", word)), len(words))
            for i, word in enumerate(words):
                # `specgen ...` (after any VAR=value), or a launcher's `... -m specgen ...`
                if (i == lead and word.split("/")[-1] == "specgen") or (word == "specgen" and i > 0
                                                                       and words[i - 1] == "-m"):
                    found.append((first + offset, words[i + 1:]))
                    break
    return found


ALL = [(page.relative_to(ROOT), line, args) for page in PAGES for line, args in commands(page)]


def test_the_pages_show_commands():
    # the check is not vacuous: the README's quick starts alone show every command
    shown = {args[0] for _, _, args in ALL if args}
    assert {"run", "bench", "inspect-checkpoint", "train-draft"} <= shown, shown


@pytest.mark.parametrize(("page", "line", "args"), ALL, ids=[f"{p}:{n}" for p, n, _ in ALL])
def test_a_documented_command_parses_and_its_recipe_loads(page, line, args):
    group = typer.main.get_command(app)
    with group.make_context("specgen", ["--help"], resilient_parsing=True) as parent:
        command = group.get_command(parent, args[0]) if args else None
        assert command is not None, f"{page}:{line}: no such command: specgen {' '.join(args)}"
        try:
            ctx = command.make_context(args[0], list(args[1:]), parent=parent)
        except typer.Exit:                  # --help: parsed, nothing more to check
            return
        except typer.TyperException as err:  # click's usage errors (typer vendors click)
            pytest.fail(f"{page}:{line}: specgen {' '.join(args)}: {err.format_message()}")
    params = ctx.params
    if args[0] not in RECIPE_ARGS:
        return
    paths = params.get("recipes") or [params.get("recipe")]
    sets = list(params.get("set_") or ())
    for path in paths:
        if path is None or not str(path).startswith("recipes/"):
            continue                         # the reader's own recipe, named as a stand-in
        recipe = ROOT / path
        assert recipe.is_file(), f"{page}:{line}: {path} does not exist"
        load_recipe(recipe, sets)            # raises RecipeError naming a field that does not exist


def test_a_renamed_flag_would_fail(tmp_path):
    """The control: the same check on a page with a flag specgen does not have."""
    page = tmp_path / "page.md"
    page.write_text("```bash\n.venv/bin/specgen run recipes/smollm2-eagle3.yaml --prompt-file x.jsonl\n```\n")
    (_, args), = commands(page)
    group = typer.main.get_command(app)
    with group.make_context("specgen", ["--help"], resilient_parsing=True) as parent:
        command = group.get_command(parent, args[0])
        with pytest.raises(typer.TyperException, match="No such option: --prompt-file"):
            command.make_context(args[0], list(args[1:]), parent=parent)


def test_every_performance_table_is_bench_output_with_its_command_commit_and_machine():
    """docs/performance.md and the README's summary hold `specgen bench --markdown` blocks as printed:
    the generator's header row, under a line naming the command and one naming commit, machine and
    date. A table typed by hand (another header) or stripped of where it came from fails."""
    from specgen.bench.markdown import markdown

    # the header rows the generator writes: without and with the llamacpp baseline's column
    headers = {markdown({"results": results}).splitlines()[4]
               for results in ([], [{"config": "llamacpp", "error": "x", "batch_size": 1}])}
    for page in (ROOT / "docs" / "performance.md", ROOT / "README.md"):
        lines = page.read_text().splitlines()
        tables = [i for i, line in enumerate(lines) if line.startswith("| ") and
                  (i == 0 or not lines[i - 1].startswith("|"))]
        assert tables or page.name == "README.md", f"{page}: no table"
        for i in tables:
            if page.name == "README.md" and "tok/s" not in lines[i]:
                continue                                        # the README's other tables
            assert lines[i] in headers, f"{page}:{i + 1}: not a bench --markdown table"
            assert lines[i - 2].startswith("commit ") and "20" in lines[i - 2], f"{page}:{i - 1}"
            assert lines[i - 4].startswith("`specgen bench "), f"{page}:{i - 3}"
