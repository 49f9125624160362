"""Tiny random DFlash checkpoints in the real layout (z-lab Qwen3-8B-DFlash-b16), scaled down.

The config starts from the real config.json and only shrinks sizes; the weight keys are the real
ones (`layers.{i}.self_attn.{q,k,v,o}_proj`, `{q,k}_norm`, `mlp.*`, norms, `fc`, `hidden_norm`,
`norm`; no embedding, no head).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from checkpoints import reference_config
from safetensors.torch import save_file


def tiny_dflash_config(target: dict, *, layers: int = 2, block_size: int = 8, block_in_dflash: bool = False,
                       target_layer_ids: list[int] | None = None, sliding_window: int | None = None,
                       rope: str = "rope_scaling", **changes) -> dict:
    """z-lab Qwen3-8B-DFlash-b16's config.json for a tiny target (hidden size = the target's).

    `sliding_window` makes the last layer a sliding_attention layer; `rope` picks the spelling
    (`rope_scaling` + `rope_theta`, or transformers 5's `rope_parameters`)."""
    config = reference_config("z-lab__Qwen3-8B-DFlash-b16.config.json")
    h = target["hidden_size"]
    config.update(hidden_size=h, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, num_hidden_layers=layers, max_window_layers=layers,
                  num_target_layers=target["num_hidden_layers"], vocab_size=target["vocab_size"])
    config["dflash_config"] = {"mask_token_id": target["vocab_size"] - 2}
    if target_layer_ids is not None:
        config["dflash_config"]["target_layer_ids"] = target_layer_ids
    config.pop("block_size")
    if block_in_dflash:
        config["dflash_config"]["block_size"] = block_size
    else:
        config["block_size"] = block_size
    config["layer_types"] = ["full_attention"] * layers
    if sliding_window is not None:
        config["layer_types"][-1] = "sliding_attention"
        config.update(sliding_window=sliding_window, use_sliding_window=True)
    if rope == "rope_parameters":
        config.pop("rope_theta")
        config.pop("rope_scaling")
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}
    else:
        config.update(rope_theta=5000.0, rope_scaling=None)
    config.update(changes)
    return config


def write_dflash_checkpoint(folder: Path, config: dict, *, seed: int = 1, scale: float = 0.08) -> Path:
    gen = torch.Generator().manual_seed(seed)
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    inner = config.get("dflash_config") or {}
    n = len(inner.get("target_layer_ids") or [0] * config["num_hidden_layers"])

    def w(*shape):
        return torch.randn(*shape, generator=gen) * scale

    def norm(dim):
        return 1 + 0.1 * torch.randn(dim, generator=gen)

    state = {"fc.weight": w(h, n * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        state.update({
            f"{p}self_attn.q_proj.weight": w(heads * d, h),
            f"{p}self_attn.k_proj.weight": w(kv * d, h),
            f"{p}self_attn.v_proj.weight": w(kv * d, h),
            f"{p}self_attn.o_proj.weight": w(h, heads * d),
            f"{p}self_attn.q_norm.weight": norm(d),
            f"{p}self_attn.k_norm.weight": norm(d),
            f"{p}mlp.gate_proj.weight": w(inter, h),
            f"{p}mlp.up_proj.weight": w(inter, h),
            f"{p}mlp.down_proj.weight": w(h, inter),
            f"{p}input_layernorm.weight": norm(h),
            f"{p}post_attention_layernorm.weight": norm(h),
        })
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
