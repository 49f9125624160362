"""The repository stands alone: a fresh clone into an empty folder has everything its tests read.

The checkpoint layouts the tests build from (config.json files and weight key/shape listings of
public checkpoints) live in tests/layouts, inside the repository. No tracked file may read, or
point people at, a folder named "shared" BESIDE the repository (the parent folder's sibling), nor
fall back to one: a clone elsewhere has no such folder and would fail with FileNotFoundError.

The patterns below are built from pieces so that this file does not match them itself.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "outputs", "__pycache__", ".pytest_cache", ".cache", "build", "dist",
             ".whl", ".gl", ".device"}
MAX_BYTES = 4 << 20      # larger tracked files are weights (drafts/*/model.safetensors), not text

_NAME = "sha" + "red"
_UP = re.escape("." + ".")
_Q = r"""['"]"""
NEEDLES = {
    "a relative path up to the sibling folder": re.compile(_UP + r"[/\\]+" + _NAME + r"\b"),
    "parents[n] / <that folder>": re.compile(r"parents\[\s*\d+\s*\]\s*/\s*" + _Q + _NAME + _Q),
    "parent.parent / <that folder>": re.compile(r"\.parent\s*\.parent\s*/\s*" + _Q + _NAME + _Q),
    "<that folder> / reference": re.compile(_Q + _NAME + _Q + r"\s*/\s*" + _Q + "reference" + _Q),
    "<that folder>/reference in a path": re.compile(r"(?<![\w-])" + _NAME + r"[/\\]reference\b"),
    "os.path.join(up, <that folder>)": re.compile(_Q + _UP + _Q + r"\s*,\s*" + _Q + _NAME + _Q),
}


def repo_files() -> list[Path]:
    """Tracked files, plus untracked ones git does not ignore (a new file counts before its commit);
    without git, every file under the repository outside the build and cache folders."""
    git = shutil.which("git")
    if git and (REPO / ".git").exists():
        done = subprocess.run([git, "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              capture_output=True, check=False)
        if done.returncode == 0:
            names = sorted({name for name in done.stdout.decode().split("\0") if name})
            return [REPO / name for name in names if (REPO / name).is_file()]
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        found += [Path(root) / name for name in sorted(files)]
    return found


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary or a weights-sized file."""
    if path.stat().st_size > MAX_BYTES:
        return None
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def offences(text: str) -> list[str]:
    hits = []
    for line_number, line in enumerate(text.splitlines(), 1):
        for what, needle in NEEDLES.items():
            if needle.search(line):
                hits.append(f"{line_number}: {what}: {line.strip()[:120]}")
    return hits


def test_the_needles_catch_the_old_ways_and_spare_ordinary_uses():
    up, name = "." + ".", _NAME
    caught = [
        f"REFERENCE = Path(__file__).resolve().parents[{2}] / \"{name}\" / \"reference\" / \"checkpoints\"",
        f"    REFERENCE = Path(__file__).resolve().parents[1] / '{name}' / 'reference'",
        f'"""Tiny random checkpoints in the REAL layouts of {up}/{name}/reference/checkpoints."""',
        f"See `{up}/{name}/DESIGN.md`.",
        f"# gguf wheel, and {up}/{name}/reference copied to ./{name}/reference",
        f"HERE.parent.parent / \"{name}\"",
        f"os.path.join(HERE, \"{up}\", \"{name}\")",
    ]
    spared = [
        f"first, second = tokens(1, \"{name}\"), tokens(2, \"{name}\")",
        f"shutil.copytree(tmp_path / \"{name}\", tmp_path / \"own\")",
        f"one {name} cache; this {name} 2-core VM; {name}_prompts(folder)",
        "LAYOUTS_DIR = Path(__file__).resolve().parent / \"layouts\"",
    ]
    assert all(offences(line) for line in caught), [line for line in caught if not offences(line)]
    assert not [line for line in spared if offences(line)]


def test_no_file_of_the_repository_reads_or_names_a_folder_beside_it():
    files = repo_files()
    assert any(path.name == "checkpoints.py" for path in files)      # the listing found the tree
    sibling = str(REPO.parent / _NAME)
    bad = {}
    for path in files:
        text = text_of(path)
        if text is None:
            continue
        hits = offences(text)
        hits += [f"names {sibling}" for _ in range(text.count(sibling))]
        if hits:
            bad[str(path.relative_to(REPO))] = hits
    assert not bad, f"files that reach outside the repository: {bad}"


def test_every_layout_the_tests_read_is_inside_the_repository():
    from checkpoints import LAYOUTS_DIR          # imported here: the scan above needs no helper module
    from header_checkpoints import LAYOUTS

    assert LAYOUTS_DIR.resolve().is_relative_to(REPO)
    named = {name for files in LAYOUTS.values() for name in files[:2]}
    for path in sorted(Path(__file__).parent.glob("*.py")):
        named |= set(re.findall(r"reference_config\(\s*\"([^\"]+)\"", path.read_text()))
    for path in sorted((REPO / "recipes").glob("*.yaml")):            # the dummy-weight recipes' configs
        named |= set(re.findall(r"tests/layouts/([\w.-]+\.json)", path.read_text()))
    assert named, "no layout names found"
    assert sorted(name for name in named if not (LAYOUTS_DIR / name).is_file()) == []


def test_the_layouts_readme_names_a_source_for_every_file():
    from checkpoints import LAYOUTS_DIR

    readme = (LAYOUTS_DIR / "README.md").read_text()
    assert sorted(path.name for path in LAYOUTS_DIR.glob("*.json") if f"`{path.name}`" not in readme) == []
