"""Build a target model from an HF config (and weights), by architecture.

Contract: `load_target(config, folder, dtype=..., device=..., dummy=...)` returns a model in eval mode
on `device` with the target interface used by pipelines/ (forward, embed, head, new_cache,
num_layers, hidden_size, vocab_size). `TARGET_ARCHITECTURES` is the one table of
supported architectures.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specgen.checkpoints.store import CheckpointError, weight_files
from specgen.checkpoints.weights import load_into, random_init, read_tensors
from specgen.models import llama
from specgen.models.layers import rope_inv_freq

# HF `architectures[0]` -> (config class, model class, weight adapter)
TARGET_ARCHITECTURES = {
    "LlamaForCausalLM": (llama.LlamaConfig, llama.LlamaForCausalLM, llama.convert_hf_state_dict),
}


def architecture_name(config: dict) -> str:
    names = config.get("architectures") or []
    if not names and config.get("model_type") == "llama":
        return "LlamaForCausalLM"
    return next((n for n in names if n in TARGET_ARCHITECTURES), str(names or config.get("model_type")))


def target_architecture(config: dict, where: str = "config.json"):
    name = architecture_name(config)
    if name not in TARGET_ARCHITECTURES:
        raise CheckpointError(f"{where}: architecture {name} is not supported "
                              f"(supported: {', '.join(TARGET_ARCHITECTURES)})")
    return TARGET_ARCHITECTURES[name]


def target_config(config: dict, where: str = "config.json"):
    config_cls, _, _ = target_architecture(config, where)
    try:
        return config_cls.from_hf(config)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: cannot read the model config: {err!r}") from err


def load_target(config: dict, folder: Path | None, *, dtype: torch.dtype, device, dummy: bool,
                seed: int = 0):
    where = str(folder / "config.json") if folder else "config.json"
    _, model_cls, adapter = target_architecture(config, where)
    cfg = target_config(config, where)
    if dummy:
        with torch.device(device):
            model = model_cls(cfg).to(dtype)
        random_init(model, seed=seed)
    else:
        with torch.device("meta"):
            model = model_cls(cfg)
        state = adapter(read_tensors(weight_files(folder)), cfg)
        load_into(model, state, dtype=dtype, device=device, where=str(folder))
    model.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope).to(device)
    return model.eval().requires_grad_(False)
