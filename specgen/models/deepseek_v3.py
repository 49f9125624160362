"""DeepSeek-V3 target model (our own code): MLA attention with the latent cache, then MoE layers.

Contract: `DeepseekV3ForCausalLM` is a `Target` (models/protocol.py), like models/llama.py: the same
`forward(tokens, positions, cache, attn, capture)`, layer ids naming layer OUTPUTS. Its cache is a
`mla.LatentCache` (kv_lora_rank + qk_rope_head_dim values per token and layer). Layers
0..first_k_dense_replace-1 have a dense gated MLP, the rest a `moe.MoE`.

Numerics follow transformers' `DeepseekV3ForCausalLM` (the reference in tests): yarn rope with its
attention factor on cos/sin and mscale^2 on the softmax scale, rope dims interleaved unless the
config says `rope_interleave: false`, router in float32.

Weights: HF keys (`model.layers.{i}.self_attn.q_a_proj.weight`, `...mlp.experts.{e}.gate_proj.weight`,
...). The adapter stacks the experts, fuses gate|up, and drops `model.layers.{N}.*` with N >=
num_hidden_layers: that is the MTP layer (drafts/mtp.py reads it from the same files). Block-FP8
weights are dequantised before they get here (checkpoints/quantized.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from specgen.models.attention import AttentionBatch
from specgen.models.decoder import DecoderTarget, beyond_last_layer
from specgen.models.layers import (
    Attention,
    GatedMLP,
    RMSNorm,
    cached,
    fuse_attention_and_mlp_keys,
    rope_cos_sin,
    rope_inv_freq,
)
from specgen.models.mla import LatentAttention, LatentCache, MlaDims
from specgen.models.moe import MoE, MoeConfig, stack_expert_keys
from specgen.models.products import Linear
from specgen.models.protocol import TargetBuilder, TargetShape
from specgen.models.tensor_header import ShapeMismatch
from specgen.models.tensor_parallel import (
    TensorParallel,
    rank_shape,
    reduced,
    shard_gated_mlp,
    split_block,
    split_evenly,
    split_rows,
)


@dataclass(frozen=True, slots=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    first_k_dense_replace: int
    rms_norm_eps: float
    mla: MlaDims
    moe: MoeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf(cls, config: dict) -> DeepseekV3Config:
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (silu)")
        if int(config.get("moe_layer_freq", 1)) != 1:
            raise ValueError("moe_layer_freq other than 1 is not supported")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            first_k_dense_replace=int(config.get("first_k_dense_replace") or 0),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            mla=MlaDims.from_hf(config),
            moe=MoeConfig.from_hf(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            num_nextn_predict_layers=int(config.get("num_nextn_predict_layers") or 0),
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        )

    @property
    def num_heads(self) -> int:
        return self.mla.num_heads

    def sharded(self, tp: TensorParallel) -> DeepseekV3Config:
        """One tensor-parallel rank's slice (models/tensor_parallel.py): its MLA heads, dense MLP
        rows, and its routed experts or their rows; the shared experts' rows."""
        m = self.moe
        split_evenly(m.moe_intermediate_size * m.n_shared_experts, tp, "shared experts' intermediate size")
        if tp.expert_parallel:
            first = split_evenly(m.n_routed_experts, tp, "routed experts") * tp.rank
        else:
            first = 0
            split_evenly(m.moe_intermediate_size, tp, "expert intermediate size")
        return replace(self, mla=replace(self.mla, num_heads=split_evenly(self.mla.num_heads, tp, "attention heads")),
                       intermediate_size=split_evenly(self.intermediate_size, tp, "intermediate size"),
                       moe=replace(m, shards=tp.size, expert_parallel=tp.expert_parallel, first_expert=first))

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def layer_parameters(self, layer: int) -> int:
        h = self.hidden_size
        mlp = self.moe.parameters() if self.is_moe(layer) else 3 * h * self.intermediate_size
        return self.mla.parameters(h, h) + mlp + 2 * h

    def num_parameters(self) -> int:
        """Parameter count from the config alone (every expert: what must sit in memory)."""
        h = self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        layers = sum(self.layer_parameters(i) for i in range(self.num_layers))
        return layers + self.vocab_size * h + h + head

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return LatentCache.bytes_per_token(self.num_layers, self.mla.latent_dim, dtype)

    def full_kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What a cache of expanded per-head keys and values would take (the comparison MLA wins)."""
        m = self.mla
        per_layer = m.num_heads * (m.qk_head_dim + m.v_head_dim)
        return self.num_layers * per_layer * torch.empty((), dtype=dtype).element_size()

    def shape(self) -> TargetShape:
        # Drafts in the target's shape (dummy EAGLE-3 / DFlash / Llama MTP) get GQA attention with
        # the target's heads and value head dim: they keep their own caches (DESIGN.md section 5).
        m = self.mla
        return TargetShape(self.num_layers, self.hidden_size, self.intermediate_size, m.num_heads,
                           m.num_heads, m.v_head_dim, self.vocab_size, self.rms_norm_eps, m.rope)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, layer: int, in_dim: int | None = None,
                 tp: TensorParallel = TensorParallel()) -> None:
        """`cfg`: this rank's slice under tensor parallelism (`tp`), whose partial sums the layer
        adds over `tp.group` after attention and after its MLP or MoE."""
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = LatentAttention(in_dim or h, h, cfg.mla, cfg.attention_bias)
        self.self_attn.o_proj = reduced(self.self_attn.o_proj, tp)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.is_moe(layer):
            self.mlp = MoE(cfg.moe, group=tp.group if tp.active else None)
        else:
            self.mlp = GatedMLP(h, cfg.intermediate_size)
            self.mlp.down_proj = reduced(self.mlp.down_proj, tp)

    def forward(self, h, cos, sin, cache, layer, batch: AttentionBatch):
        return self.residual(h, cos, sin, cached(cache, layer, batch))

    def residual(self, h, cos, sin, attention: Attention):
        # h: [B, T, H] -> [B, T, H]
        h = h + attention(self.self_attn, self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(cfg, i, tp=tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3ForCausalLM(DecoderTarget):
    # kept FP8 weights this model reads as matrices: MLA absorbs kv_b_proj's per-head blocks
    FP8_DEQUANTIZED = ("kv_b_proj",)

    def __init__(self, cfg: DeepseekV3Config, tp: TensorParallel = TensorParallel()) -> None:
        """`tp`: this rank's slice of a tensor-parallel target; its `config` is then the slice's."""
        super().__init__()
        cfg = rank_shape(cfg, tp)
        self.config = cfg
        self.shape = cfg.shape()
        self.model = DeepseekV3Model(cfg, tp)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope_scale = cfg.mla.rope.attention_factor()
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return rope_inv_freq(self.config.mla.qk_rope_head_dim, self.config.mla.rope)

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device) -> LatentCache:
        return LatentCache(self.config.num_layers, slots, max_len, self.config.mla.latent_dim, dtype, device)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        # positions: [B, T] -> cos, sin [B, T, 1, qk_rope_head_dim], with yarn's attention factor
        return rope_cos_sin(positions, self.inv_freq, dtype, self.rope_scale)


def adapt_layer_keys(state: dict[str, torch.Tensor], prefix: str, num_experts: int) -> None:
    """One decoder layer's checkpoint keys under `prefix` -> ours, in place (dense gate|up fused,
    experts stacked)."""
    fuse_attention_and_mlp_keys(state, prefix)    # MLA has no q/k/v projections: gate|up only
    stack_expert_keys(state, f"{prefix}mlp.", num_experts)


def convert_hf_state_dict(state: dict[str, torch.Tensor], cfg: DeepseekV3Config) -> dict[str, torch.Tensor]:
    """HF DeepSeek-V3 keys -> ours; the MTP layer(s) past the last layer are left to drafts/mtp.py."""
    state = {k: v for k, v in state.items() if not beyond_last_layer(k, cfg.num_layers)}
    for i in range(cfg.num_layers):
        adapt_layer_keys(state, f"model.layers.{i}.", cfg.moe.n_routed_experts)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def shard_state(state: dict[str, torch.Tensor], cfg: DeepseekV3Config, tp: TensorParallel) -> dict[str, torch.Tensor]:
    """A converted state cut to rank `tp.rank`'s slice, in place (`cfg`: the whole model's)."""
    m = cfg.moe
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for name in ("q_proj.weight", "q_b_proj.weight", "kv_b_proj.weight"):   # rows grouped by head
            if attn + name in state:
                split_block(state, attn + name, tp, dim=0)
        split_block(state, attn + "o_proj.weight", tp, dim=1)
        if not cfg.is_moe(i):
            shard_gated_mlp(state, mlp, cfg.intermediate_size, tp)
            continue
        gate_up, down = mlp + "experts.gate_up_proj", mlp + "experts.down_proj"
        if gate_up + "_packed" in state:
            shard_int4_experts(state, gate_up, down, m.moe_intermediate_size, tp)
        elif tp.expert_parallel:
            split_block(state, gate_up, tp, dim=0)
            split_block(state, down, tp, dim=0)
        else:   # [E, 2I, H] and [E, H, I]: each expert's gate and up rows, and its down columns
            split_rows(state, gate_up, [m.moe_intermediate_size] * 2, tp, dim=1)
            split_block(state, down, tp, dim=2)
        if m.n_shared_experts:
            shard_gated_mlp(state, mlp + "shared_experts.", m.moe_intermediate_size * m.n_shared_experts, tp)
    return state


def shard_int4_experts(state: dict, gate_up: str, down: str, intermediate: int, tp: TensorParallel) -> None:
    """Packed INT4 expert stacks (kernels/int4_experts.py) cut with their scales, in place: whole
    experts per rank (expert parallel), or each expert's gate and up rows (words and scales alike:
    rows are rows) and its down columns, which are packed words (8 inputs) and scale groups (g
    inputs): a rank's share of the intermediate size must fill whole groups."""
    if tp.expert_parallel:
        for key in (gate_up, down):
            split_block(state, key + "_packed", tp, dim=0)
            split_block(state, key + "_scale", tp, dim=0)
        return
    for part in ("_packed", "_scale"):
        split_rows(state, gate_up + part, [intermediate] * 2, tp, dim=1)
    words, groups = state[down + "_packed"].shape[2], state[down + "_scale"].shape[2]
    group = intermediate // groups
    if (intermediate // tp.size) % group or groups % tp.size or words % tp.size:
        raise ShapeMismatch(f"runtime.tensor_parallel_size {tp.size} cuts {down} ({intermediate} inputs) inside "
                            f"its {group}-wide INT4 groups; set runtime.expert_parallel: true, or "
                            "target.quantization: none to dequantise the experts")
    split_block(state, down + "_packed", tp, dim=2)
    split_block(state, down + "_scale", tp, dim=2)


ARCHITECTURE = TargetBuilder(DeepseekV3Config, DeepseekV3ForCausalLM, convert_hf_state_dict, shard_state=shard_state)
