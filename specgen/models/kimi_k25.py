"""Kimi K2.5 target: DeepSeek-V3's text model inside a multimodal wrapper, run on text prompts.

Contract: `ARCHITECTURE` builds our `DeepseekV3ForCausalLM` from a `KimiK25ForConditionalGeneration`
config.json. The text model's config sits under `text_config` (`model_type` kimi_k2 or
deepseek_v3; `rope_scaling` or `rope_parameters`; `torch_dtype` or `dtype` — RopeSettings and the
loader read either spelling), and its weights under `language_model.` (`language_model.model.*`,
`language_model.lm_head.weight`). Vision weights (`vision_tower.*`, `mm_projector.*`) are never read
(`reads`), and the job notes it in the log: prompts here are text only.
"""

from __future__ import annotations

import torch

from specgen.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, convert_hf_state_dict, shard_state
from specgen.models.protocol import TargetBuilder

TEXT_PREFIX = "language_model."
TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")


def text_config(config: dict) -> dict:
    """The text model's config; top-level ids (eos, vocab) fill what it leaves out."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ValueError("a KimiK25ForConditionalGeneration config needs a text_config section")
    model_type = text.get("model_type", "deepseek_v3")
    if model_type not in TEXT_MODEL_TYPES:
        raise ValueError(f"text_config.model_type {model_type!r} is not supported ({', '.join(TEXT_MODEL_TYPES)})")
    return {**{k: v for k, v in config.items() if k in ("vocab_size", "tie_word_embeddings")}, **text}


class KimiK25Config:
    """Reads the wrapper config; the result is the text model's `DeepseekV3Config`."""

    @staticmethod
    def from_hf(config: dict) -> DeepseekV3Config:
        return DeepseekV3Config.from_hf(text_config(config))


def convert_kimi_state_dict(state: dict[str, torch.Tensor], cfg: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """`language_model.*` keys -> DeepSeek-V3's; everything else (the vision encoder) is dropped."""
    text = {k[len(TEXT_PREFIX):]: v for k, v in state.items() if k.startswith(TEXT_PREFIX)}
    return convert_hf_state_dict(text, cfg)


def is_text_weight(name: str) -> bool:
    return name.startswith(TEXT_PREFIX)


ARCHITECTURE = TargetBuilder(KimiK25Config, DeepseekV3ForCausalLM, convert_kimi_state_dict, is_text_weight,
                             shard_state=shard_state)
