"""Llama-3 target model (our own code, not transformers').

Contract: `LlamaForCausalLM` is a `Target` (models/protocol.py): `forward(tokens[B, T], positions[B, T],
cache, attn, capture)` writes the K/V of the T new tokens of each row at that row's positions, attends
causally over the cache, and returns the last layer's output plus the hidden states of the layers a
draft asked for. Layer ids name layer OUTPUTS (id i = the residual stream leaving layer i, HF
`hidden_states[i + 1]`), the convention of every draft checkpoint (DESIGN.md section 5).

Parameter names follow the HF checkpoint (`model.layers.{i}...`) except that q/k/v and gate/up are
fused; `convert_hf_state_dict` is the weight adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specgen.models.attention import AttentionBatch, KVCache
from specgen.models.decoder import DecoderTarget, beyond_last_layer
from specgen.models.layers import (
    Attention,
    CachedSelfAttention,
    GatedMLP,
    RMSNorm,
    RopeSettings,
    cached,
    fuse_attention_and_mlp_keys,
    rope_cos_sin,
    rope_inv_freq,
)
from specgen.models.products import Linear
from specgen.models.protocol import TargetBuilder, TargetShape
from specgen.models.tensor_parallel import TensorParallel, llama_sharded, rank_shape, reduced, shard_fused_state


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSettings
    tie_word_embeddings: bool
    attention_bias: bool = False
    max_position_embeddings: int = 8192

    @classmethod
    def from_hf(cls, config: dict) -> LlamaConfig:
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=RopeSettings.from_hf(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
        )

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer (attention, MLP, two norms)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        return attn + 3 * h * self.intermediate_size + 2 * h

    def num_parameters(self) -> int:
        """Parameter count from the config alone (memory estimates before loading)."""
        h = self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * self.layer_parameters() + self.vocab_size * h + h + head

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return KVCache.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype)

    def sharded(self, tp: TensorParallel) -> LlamaConfig:
        """One tensor-parallel rank's slice (models/tensor_parallel.py)."""
        return llama_sharded(self, tp)

    def shape(self) -> TargetShape:
        return TargetShape(self.num_layers, self.hidden_size, self.intermediate_size, self.num_heads,
                           self.num_kv_heads, self.head_dim, self.vocab_size, self.rms_norm_eps, self.rope)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = CachedSelfAttention(cfg.hidden_size, cfg.hidden_size, cfg.num_heads,
                                             cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, cos, sin, cache, layer, batch: AttentionBatch):
        return self.residual(h, cos, sin, cached(cache, layer, batch))

    def residual(self, h, cos, sin, attention: Attention):
        # h: [B, T, H] -> [B, T, H]; `attention` decides where the keys come from
        h = h + attention(self.self_attn, self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(DecoderTarget):
    def __init__(self, cfg: LlamaConfig, tp: TensorParallel = TensorParallel()) -> None:
        """`tp`: this rank's slice of a tensor-parallel target (models/tensor_parallel.py); its
        `config` is then the slice's (its heads, KV heads and MLP rows)."""
        super().__init__()
        cfg = rank_shape(cfg, tp)
        self.config = cfg
        self.shape = cfg.shape()
        self.model = LlamaModel(cfg)
        for layer in self.model.layers:
            layer.self_attn.o_proj = reduced(layer.self_attn.o_proj, tp)
            layer.mlp.down_proj = reduced(layer.mlp.down_proj, tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one tensor, two names
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return rope_inv_freq(self.config.head_dim, self.config.rope)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, slots, c.num_kv_heads, max_len, c.head_dim, dtype, device)


def convert_hf_state_dict(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """HF Llama keys -> ours (fused projections; tied head materialised as the embedding).

    Layers at index >= num_layers are MTP layers (DeepSeek layout, drafts/mtp.py), not the target's:
    dropped here, as transformers does."""
    state = {k: v for k, v in state.items() if not beyond_last_layer(k, cfg.num_layers)}
    for i in range(cfg.num_layers):
        fuse_attention_and_mlp_keys(state, f"model.layers.{i}.")
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # the same tensor: one copy
    return state


def shard_state(state: dict[str, torch.Tensor], cfg: LlamaConfig, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """A converted state cut to rank `tp.rank`'s slice (`cfg`: the whole model's config)."""
    return shard_fused_state(state, cfg, tp, [f"model.layers.{i}." for i in range(cfg.num_layers)])


ARCHITECTURE = TargetBuilder(LlamaConfig, LlamaForCausalLM, convert_hf_state_dict, shard_state=shard_state)
