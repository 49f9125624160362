"""Tiny random DeepSeek-V3 and Kimi K2.5 checkpoints in the real layouts, scaled down.

The configs start from the real config.json files (tests/layouts) and only shrink
sizes; the weights come from transformers' own `DeepseekV3ForCausalLM` (random, sharpened), written
under the real key names: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.gate.weight`
+ `e_score_correction_bias`, `shared_experts.*`, and the MTP layer `model.layers.{N}.*` (embed_tokens,
enorm, hnorm, eh_proj, the block, shared_head.{norm,head}). Options: block-FP8 weights with
`weight_scale_inv` (DeepSeek's release format), and the Kimi K2.5 wrapper (`text_config`,
`language_model.` prefix, a few vision tensors that a text run must skip).

`hf_reference(folder)` returns the transformers model holding exactly the weights our loader reads
(FP8 dequantised the same way), for logits comparisons. `write_tiktoken_tokenizer` gives a folder
Kimi's tokenizer layout (`tiktoken.model`, specials in tokenizer_config.json, optionally a chat
template).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from checkpoints import reference_config
from safetensors.torch import save_file

SMALL_DEEPSEEK = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 4, "num_hidden_layers": 3, "first_k_dense_replace": 1,
    "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "n_shared_experts": 1,
    "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "vocab_size": 96, "bos_token_id": 1, "eos_token_id": 2, "max_position_embeddings": 4096,
}
FP8_BLOCK = [16, 16]   # DeepSeek's is [128, 128]; small blocks so that tiny weights span several


def tiny_deepseek_config(*, yarn: bool = True, q_lora: bool = True, fp8: bool = False, mtp: bool = True,
                         **changes) -> dict:
    """DeepSeek-V3's config.json scaled down (yarn kept live: original context 16 positions)."""
    config = reference_config("deepseek-ai__DeepSeek-V3.config.json")
    config.update(SMALL_DEEPSEEK)
    config["rope_scaling"] = dict(config["rope_scaling"], original_max_position_embeddings=16, factor=8)
    if not yarn:
        config["rope_scaling"] = None
    if not q_lora:
        config["q_lora_rank"] = None
    config["num_nextn_predict_layers"] = 1 if mtp else 0
    config.pop("quantization_config")
    config.pop("auto_map")
    if fp8:
        config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                         "weight_block_size": FP8_BLOCK}
    config.update(changes)
    return config


def tiny_kimi_config(*, int4: bool = False, **changes) -> dict:
    """Kimi K2.5's wrapper config with its text_config scaled down (kimi_k2, one group, no MTP).
    `int4` keeps the release's quantization_config (routed experts packed INT4, groups of 32)."""
    config = reference_config("moonshotai__Kimi-K2.5.config.RECONSTRUCTED-raw.json")
    text = dict(config["text_config"])
    text.update(SMALL_DEEPSEEK)
    text.update(n_group=1, topk_group=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    text["rope_scaling"] = dict(text["rope_scaling"], original_max_position_embeddings=16, factor=4)
    if not int4:
        text.pop("quantization_config")
    text.pop("auto_map")
    text.update(changes)
    config.pop("auto_map")
    config.update(text_config=text, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return config


def hf_config(config: dict):
    from transformers import DeepseekV3Config

    fields = {k: v for k, v in config.items() if k not in ("quantization_config", "architectures")}
    return DeepseekV3Config(**fields)


def hf_model(config: dict, seed: int, layers: int | None = None):
    """transformers' DeepseekV3ForCausalLM, random and sharpened (layers: override the count)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config({**config, **({"num_hidden_layers": layers} if layers else {})})
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:   # a live correction bias: routing must read it
                gate.e_score_correction_bias.copy_(0.05 * torch.randn_like(gate.e_score_correction_bias))
    return model


def real_layout(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors -> the checkpoint's per-expert keys."""
    out = {}
    inter = config["moe_intermediate_size"]
    for key, t in state.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base = key[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif key.endswith("mlp.experts.down_proj"):
            base = key[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[key] = t
    return {k: v.contiguous().clone() for k, v in out.items()}


def quantize_fp8(weight: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 as DeepSeek stores it: e4m3 values and the per-block multiplier back (scale_inv)."""
    rows, cols = weight.shape
    bo, bi = block
    scale_inv = torch.zeros(math.ceil(rows / bo), math.ceil(cols / bi))
    q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = weight[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale_inv[i, j] = s
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale_inv


def pack_int4(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """compressed-tensors' pack-quantized INT4 (symmetric, per group of inputs), written here from the
    format's description: value in [-8, 7] stored as value + 8, eight per int32, lowest bits first."""
    rows, cols = weight.shape
    scale = weight.abs().view(rows, cols // group, group).amax(-1) / 7
    q = torch.round(weight / scale.repeat_interleave(group, 1)).clamp(-8, 7).to(torch.int64) + 8
    packed = torch.zeros(rows, math.ceil(cols / 8), dtype=torch.int64)
    for i in range(cols):
        packed[:, i // 8] |= q[:, i] << (4 * (i % 8))
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return {"weight_packed": packed, "weight_scale": scale.to(torch.bfloat16),
            "weight_shape": torch.tensor([rows, cols], dtype=torch.int32)}


def is_fp8_weight(key: str, t: torch.Tensor) -> bool:
    """DeepSeek quantises the projections' weights; embeddings, head, norms and router stay bf16."""
    return (t.ndim == 2 and key.endswith("proj.weight") and "eh_proj" not in key)


def write_deepseek_checkpoint(folder: Path, config: dict, *, seed: int = 0) -> Path:
    """A DeepSeek-V3 checkpoint (and its MTP layer when num_nextn_predict_layers is 1)."""
    n = config["num_hidden_layers"]
    mtp = int(config.get("num_nextn_predict_layers") or 0)
    model = hf_model(config, seed, layers=n + mtp)   # the MTP block is layer N of the same stack
    state = real_layout(model.state_dict(), config)
    if mtp:
        gen = torch.Generator().manual_seed(seed + 1)
        h, v = config["hidden_size"], config["vocab_size"]
        p = f"model.layers.{n}."
        state.update({p + "enorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                      p + "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                      p + "eh_proj.weight": 0.08 * torch.randn(h, 2 * h, generator=gen),
                      p + "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=gen),
                      # DeepSeek stores copies of the target's embedding and head in the MTP layer
                      p + "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                      p + "shared_head.head.weight": state["lm_head.weight"].clone()})
    quant = config.get("quantization_config")
    if quant:
        for key in [k for k, t in state.items() if is_fp8_weight(k, t)]:
            state[key], state[key + "_scale_inv"] = quantize_fp8(state[key], quant["weight_block_size"])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_kimi_checkpoint(folder: Path, config: dict, *, seed: int = 0) -> Path:
    """Kimi K2.5's layout: text weights under `language_model.`, plus vision tensors to be skipped."""
    text = config["text_config"]
    model = hf_model(text, seed)
    state = {"language_model." + k: v for k, v in real_layout(model.state_dict(), text).items()}
    quant = text.get("quantization_config")
    if quant:   # the release quantises the routed experts only
        group = quant["config_groups"]["group_0"]["weights"]["group_size"]
        for key in [k for k in state if ".mlp.experts." in k]:
            weight = state.pop(key)
            state.update({key[: -len("weight")] + part: t for part, t in pack_int4(weight, group).items()})
    gen = torch.Generator().manual_seed(seed + 2)
    state["vision_tower.encoder.blocks.0.mlp.fc0.weight"] = torch.randn(8, 4, generator=gen)
    state["mm_projector.proj.0.weight"] = torch.randn(8, 8, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


# A chat template shaped like Kimi K2.5's at its end: thinking mode (the default) opens the
# assistant's reasoning span in the prompt, instant mode (`thinking: false`) closes it at once.
KIMI_LIKE_TEMPLATE = (
    "{%- for m in messages -%}<|im_user|>{{ m['content'] }}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}")


def write_tiktoken_tokenizer(folder: Path, extra: dict[int, str], chat_template: str | None = None) -> None:
    """Kimi's tokenizer layout: `tiktoken.model` (base64 token, rank per line) and a tokenizer_config
    whose auto_map names remote code (tokenization_kimi.py), special tokens in added_tokens_decoder.
    Ids 0..255 are bytes, 256..258 "he", "ll", "hello"; `extra` places the specials."""
    import base64

    pieces = [bytes([i]) for i in range(256)] + [b"he", b"ll", b"hello"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tiktoken.model").write_text(
        "".join(f"{base64.b64encode(p).decode()} {i}\n" for i, p in enumerate(pieces)))
    config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for i, t in extra.items()},
        "bos_token": extra[min(extra)], "eos_token": extra[max(extra)]}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def hf_reference(folder: Path):
    """transformers' model with the weights of `folder` as our loader reads them (FP8 dequantised)."""
    from safetensors.torch import load_file

    from specgen.checkpoints.quantized import dequantize_state, quantization_of

    config = json.loads((folder / "config.json").read_text())
    state = load_file(str(folder / "model.safetensors"))
    if "text_config" in config:
        config = config["text_config"]
        state = {k[len("language_model."):]: v for k, v in state.items() if k.startswith("language_model.")}
    state = dequantize_state(state, quantization_of(config, str(folder)), dtype=torch.float32, where=str(folder))
    n = config["num_hidden_layers"]
    state = {k: v for k, v in state.items() if not k.startswith(f"model.layers.{n}.")}
    fused = {}
    for i in range(n):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}0.gate_proj.weight" in state:
            e = config["n_routed_experts"]
            fused[p + "gate_up_proj"] = torch.stack(
                [torch.cat((state.pop(f"{p}{j}.gate_proj.weight"), state.pop(f"{p}{j}.up_proj.weight")))
                 for j in range(e)])
            fused[p + "down_proj"] = torch.stack([state.pop(f"{p}{j}.down_proj.weight") for j in range(e)])
    model = hf_model(config, 0)
    model.load_state_dict({**state, **fused}, strict=True)
    return model.float().eval()


def tiny_mla_eagle3_config(target: dict, **changes) -> dict:
    """nvidia Kimi-K2.5-Thinking-Eagle3's config (an MLA decoder layer) for a tiny target."""
    config = reference_config("nvidia__Kimi-K2.5-Thinking-Eagle3.config.RECONSTRUCTED.json")
    mla = ("num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
           "qk_rope_head_dim", "v_head_dim")
    config.update({k: SMALL_DEEPSEEK[k] for k in mla})
    config.update(hidden_size=target["hidden_size"], intermediate_size=80, vocab_size=target["vocab_size"],
                  draft_vocab_size=target["vocab_size"], bos_token_id=1, eos_token_id=2)
    config["rope_scaling"] = dict(config["rope_scaling"], original_max_position_embeddings=16, factor=4)
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True}
    config.update(changes)
    return config


def write_mla_eagle3_checkpoint(folder: Path, config: dict, target: dict, *, seed: int = 3) -> Path:
    """Random weights under the derived key names: `layers.0.self_attn.{q_a,q_b,kv_a,kv_b,o}_proj`
    (q_a / kv_a read 2H), the norms, `mlp.*`, `fc`, `norm`, a full-vocabulary `lm_head`."""
    gen = torch.Generator().manual_seed(seed)
    h, th, inter, vocab = config["hidden_size"], target["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, ql, r = config["num_attention_heads"], config["q_lora_rank"], config["kv_lora_rank"]
    dn, dr, dv = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    n_aux = len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.08

    def norm(n):
        return 1 + 0.1 * torch.randn(n, generator=gen)

    p = "layers.0."
    state = {
        f"{p}self_attn.q_a_proj.weight": w(ql, 2 * h), f"{p}self_attn.q_a_layernorm.weight": norm(ql),
        f"{p}self_attn.q_b_proj.weight": w(heads * (dn + dr), ql),
        f"{p}self_attn.kv_a_proj_with_mqa.weight": w(r + dr, 2 * h),
        f"{p}self_attn.kv_a_layernorm.weight": norm(r),
        f"{p}self_attn.kv_b_proj.weight": w(heads * (dn + dv), r),
        f"{p}self_attn.o_proj.weight": w(h, heads * dv),
        f"{p}mlp.gate_proj.weight": w(inter, h), f"{p}mlp.up_proj.weight": w(inter, h),
        f"{p}mlp.down_proj.weight": w(h, inter),
        f"{p}hidden_norm.weight": norm(h), f"{p}input_layernorm.weight": norm(h),
        f"{p}post_attention_layernorm.weight": norm(h),
        "norm.weight": norm(h), "fc.weight": w(h, n_aux * th), "lm_head.weight": w(vocab, h),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
