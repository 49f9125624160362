"""What a path given to `inspect-checkpoint` is: an alias, a GGUF file, or a checkpoint folder, and
for a folder whether its config describes a target or a draft (and which method).

Contract: `locate(given)` returns a `Located` (folder or GGUF file) or raises `Unreadable` (exit 2)
naming what was looked for; `draft_method_of(config)` names the draft method a config describes
(None for a model that is not a draft). Nothing here reads a tensor, converts a GGUF file or loads
a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specgen.checkpoints.store import MODEL_ALIASES, CheckpointError


class Unreadable(Exception):
    """Input that cannot be read at all (a missing path, a corrupt file): exit 2."""


@dataclass(frozen=True, slots=True)
class Located:
    given: str
    folder: Path | None       # an HF-format checkpoint folder
    gguf: Path | None         # or a GGUF file (an alias names one inside an installed package)


def locate(given: str) -> Located:
    if given in MODEL_ALIASES:
        try:
            return Located(given, None, MODEL_ALIASES[given].locate())
        except CheckpointError as err:
            raise Unreadable(str(err)) from None
    path = Path(given).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Located(given, None, path)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise Unreadable(f"{path}: no config.json in this folder")
        return Located(given, path, None)
    if not path.exists():
        raise Unreadable(f"{given}: no such file or folder (and not an alias: {', '.join(MODEL_ALIASES)})")
    raise Unreadable(f"{given}: not a checkpoint folder (config.json + safetensors) or a .gguf file")


def draft_method_of(config: dict) -> str | None:
    """`dflash` or `eagle3` when the config is a draft's (by its architecture or its own section);
    None otherwise (a target, possibly with MTP layers inside)."""
    names = [str(a) for a in config.get("architectures") or []]
    if "dflash_config" in config or any("dflash" in a.lower() for a in names):
        return "dflash"
    if "eagle_config" in config or any("eagle" in a.lower() for a in names):
        return "eagle3"
    return None
