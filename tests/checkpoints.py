"""Tiny random checkpoints in the REAL layouts of tests/layouts (see its README.md), scaled down.

The configs start from the real files (Llama-3.1-8B-Instruct, EAGLE3-LLaMA3.1-Instruct-8B) and only
shrink the sizes, so every config field and weight key name our loaders meet here is the real one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

# The public checkpoints' config.json files and weight layouts, kept inside the repository
# (tests/layouts/README.md names each file's source): the one place every test helper reads them from.
LAYOUTS_DIR = Path(__file__).resolve().parent / "layouts"

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 96}


def reference_config(name: str) -> dict:
    return json.loads((LAYOUTS_DIR / name).read_text())


def tiny_llama_config(**changes) -> dict:
    """Llama-3.1-8B-Instruct's config.json (llama3 rope scaling, GQA, untied head), scaled down."""
    config = reference_config("meta-llama__Llama-3.1-8B-Instruct.config.json")
    config.update(SMALL)
    config.update(bos_token_id=1, eos_token_id=[2, 3])
    # Keep llama3 scaling live at tiny sizes: a short original context puts bands in all three regimes.
    config["rope_scaling"] = dict(config["rope_scaling"], original_max_position_embeddings=64)
    config["rope_theta"] = 10000.0
    config.update(changes)
    return config


def write_llama_checkpoint(folder: Path, config: dict, *, seed: int = 0, shard_bytes: int | None = None,
                           spelling: str = "hub") -> Path:
    """Random weights with HF's own LlamaForCausalLM, saved as safetensors (optionally sharded).

    spelling "hub" keeps `rope_theta`/`rope_scaling`/`torch_dtype` as the hub files have them;
    "transformers5" keeps what `save_pretrained` writes (`rope_parameters`, `dtype`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    with torch.no_grad():  # larger weights than the default init make logits less flat: sharper tests
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    if spelling == "hub":
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def tiny_eagle3_config(target: dict, **changes) -> dict:
    """EAGLE3-LLaMA3.1-Instruct-8B's config.json scaled to a tiny target."""
    config = reference_config("yuhuili__EAGLE3-LLaMA3.1-Instruct-8B.config.json")
    config.update(hidden_size=target["hidden_size"], intermediate_size=80, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=target["vocab_size"], draft_vocab_size=64)
    config.update(changes)
    return config


def write_eagle3_checkpoint(folder: Path, config: dict, target: dict, *, layout: str = "midlayer",
                            own_embedding: bool = False, seed: int = 1) -> Path:
    """Random EAGLE-3 weights under the real key names (`midlayer.*` or `layers.0.*`, fc, d2t, t2d)."""
    gen = torch.Generator().manual_seed(seed)
    h, th = config["hidden_size"], target["hidden_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    dvocab = config.get("draft_vocab_size") or vocab
    n_aux = len((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.08

    p = "midlayer." if layout == "midlayer" else "layers.0."
    state = {
        f"{p}self_attn.q_proj.weight": w(heads * d, 2 * h),
        f"{p}self_attn.k_proj.weight": w(kv * d, 2 * h),
        f"{p}self_attn.v_proj.weight": w(kv * d, 2 * h),
        f"{p}self_attn.o_proj.weight": w(h, heads * d),
        f"{p}mlp.gate_proj.weight": w(inter, h),
        f"{p}mlp.up_proj.weight": w(inter, h),
        f"{p}mlp.down_proj.weight": w(h, inter),
        f"{p}hidden_norm.weight": 1 + 0.1 * w(h),
        f"{p}input_layernorm.weight": 1 + 0.1 * w(h),
        f"{p}post_attention_layernorm.weight": 1 + 0.1 * w(h),
        "norm.weight": 1 + 0.1 * w(h),
        "fc.weight": w(h, n_aux * th),
        "lm_head.weight": w(dvocab, h),
    }
    if dvocab != vocab:
        # A reduced vocabulary: draft id i is target id chosen[i]; d2t stores the OFFSET chosen[i] - i.
        chosen = torch.sort(torch.randperm(vocab, generator=gen)[:dvocab]).values
        state["d2t"] = chosen - torch.arange(dvocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[chosen] = True
        state["t2d"] = t2d
    if own_embedding:
        state["embed_tokens.weight"] = w(vocab, h)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def load_fp32_target(folder: Path, device="cpu"):
    """Our model for a checkpoint folder, fp32 on the CPU (what most tests compare) or on `device`."""
    from specgen.checkpoints import read_config
    from specgen.checkpoints.loading import load_target

    return load_target(read_config(folder), folder, dtype=torch.float32, device=device, dummy=False)
