"""The layering DESIGN.md draws holds in the imports: each folder imports only the layers below it.

Every `import specgen...` / `from specgen... import` in a module counts, the ones inside functions too
(a deferred import is still a dependency). A failure names the module, the line and what it imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

import specgen

ROOT = Path(specgen.__file__).parent

# folder (or module) -> the specgen packages and modules it must never import
FORBIDDEN = {
    "kernels": ("specgen.",),     # depends on nothing else in specgen (kernels import each other only)
    "models": ("specgen.checkpoints", "specgen.drafts", "specgen.pipelines", "specgen.recipe", "specgen.cli",
               "specgen.job", "specgen.data", "specgen.registry", "specgen.bench", "specgen.training",
               "specgen.inspection"),
    "drafts": ("specgen.checkpoints", "specgen.pipelines", "specgen.recipe", "specgen.cli", "specgen.job",
               "specgen.data", "specgen.registry", "specgen.bench", "specgen.training", "specgen.inspection"),
    "checkpoints": ("specgen.pipelines", "specgen.recipe", "specgen.cli", "specgen.job", "specgen.bench",
                    "specgen.training", "specgen.inspection"),
    # structured output (formats, the grammar engine, masks) sits beside the models: below the pipelines
    "structured": ("specgen.models", "specgen.checkpoints", "specgen.drafts", "specgen.pipelines", "specgen.recipe",
                   "specgen.cli", "specgen.job", "specgen.data", "specgen.registry", "specgen.bench",
                   "specgen.training", "specgen.inspection"),
    # data parallel (world, shards, progress) sits between the pipelines and the job
    "parallel": ("specgen.recipe", "specgen.cli", "specgen.job", "specgen.bench", "specgen.training",
                 "specgen.inspection"),
    "pipelines": ("specgen.recipe", "specgen.cli", "specgen.job", "specgen.bench", "specgen.training",
                  "specgen.inspection"),
    # a job (resolve, size, build, run, count) sits above the pipelines; bench and training use it
    "job": ("specgen.cli", "specgen.bench", "specgen.training", "specgen.inspection"),
}
# Inside a folder whose modules are the steps of one job: each imports only those before it.
ORDER_WITHIN = {"job": ("__init__", "errors", "resolved", "memory", "build", "statistics", "run")}
# The runner's rooms (pipelines/runner.py's helpers) never import the runner: it imports them.
RUNNER_ROOMS = ("requests", "host_reader", "admission", "slot_grammars", "host_drafts", "narrowing", "warm_up")
ALLOWED_WITHIN = {"kernels": ("specgen.kernels",)}


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def violations(folder: str, root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / folder).rglob("*.py")):
        for line, name in imports(path):
            if name.startswith(ALLOWED_WITHIN.get(folder, ("\0",))):
                continue
            if any(name == f.rstrip(".") or name.startswith(f.rstrip(".") + ".") or
                   (f.endswith(".") and name.startswith(f)) for f in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(root.parent)}:{line} imports {name}")
    return bad


def test_each_layer_imports_only_the_layers_below_it():
    bad = [v for folder in FORBIDDEN for v in violations(folder)]
    assert not bad, "\n".join(bad)


def test_the_modules_of_a_job_import_only_the_steps_before_them():
    bad = []
    for folder, order in ORDER_WITHIN.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.stem == "__init__":       # the package's names, re-exported from its modules
                continue
            for line, name in imports(path):
                parts = name.split(".")
                if parts[:2] == ["specgen", folder] and len(parts) > 2 and \
                        order.index(parts[2]) >= order.index(path.stem):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_runners_rooms_do_not_import_the_runner():
    bad = [f"specgen/pipelines/{room}.py:{line} imports {name}" for room in RUNNER_ROOMS
           for line, name in imports(ROOT / "pipelines" / f"{room}.py") if name == "specgen.pipelines.runner"]
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_deferred_import(tmp_path):
    # negative control: a function-level import of a loader from models/ is caught
    fake = tmp_path / "specgen"
    (fake / "models").mkdir(parents=True)
    (fake / "models" / "bad.py").write_text("def f():\n    from specgen.checkpoints.store import CheckpointError\n")
    assert violations("models", fake) == ["specgen/models/bad.py:2 imports specgen.checkpoints.store"]
