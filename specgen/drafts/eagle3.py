"""EAGLE-3 draft: one 2H-wide decoder layer over fused target features, drafted as a chain.

Checkpoint layouts read (tests/layouts/README.md):
- the layer under `midlayer.*` (official EAGLE) or `layers.0.*` (speculators / vLLM);
- `fc.weight [H, 3 * H_target]` over low|mid|high target features, `norm`, `lm_head [Vd, H]`;
- `d2t [Vd]` OFFSETS (target_id = draft_id + d2t[draft_id]) and `t2d` (ignored: derivable) when the
  draft vocabulary is reduced (`draft_vocab_size` < `vocab_size`); none for a full vocabulary;
- `embed_tokens.weight` optional: absent means the target's embedding is shared;
- aux layer ids at `eagle_config.eagle_aux_hidden_state_layer_ids` (layer outputs) or the default;
- its own RoPE settings (`rope_theta`, `rope_scaling` / `rope_parameters`), often theta 10000;
- the layer's attention is Llama-style GQA (`q_proj`/`k_proj`/`v_proj`), or MLA when the config has
  `kv_lora_rank` (nvidia's Kimi-K2.5-Thinking-Eagle3: `q_a_proj`/`kv_a_proj_with_mqa` read the
  2H-wide input, yarn rope on the rope dims). Either way the draft keeps its own cache (a one-layer
  KV or latent cache), independent of the target's.

Drafting (DESIGN.md section 3, step 5). Entry j of a pass pairs the feature of position p_j with the
embedding of the token at p_j + 1 and predicts the token at p_j + 2; its draft-cache entry sits at
p_j, so the draft cache is aligned with the target's and is cut back the same way (entries past the
committed length are scratch). The first pass runs over all T new positions and reads row
`last_index`; K - 1 chained single-token passes follow, each feeding back the layer's pre-norm output
as the next feature (the loop is shared with MTP: specgen/drafts/chain.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specgen.drafts.base import DraftBuilder, Pick, TargetFit, default_aux_layer_ids, read_draft_config
from specgen.drafts.chain import chain_propose
from specgen.drafts.vocab import read_draft_vocab_size, take_d2t, to_target_logits
from specgen.errors import CheckpointError
from specgen.models.attention import AttentionBatch, KVCache
from specgen.models.layers import (
    Attention,
    CachedSelfAttention,
    GatedMLP,
    RMSNorm,
    RopeSettings,
    cached,
    float32_logits,
    fuse_attention_and_mlp_keys,
    rope_cos_sin,
    rope_inv_freq,
)
from specgen.models.materialise import build
from specgen.models.mla import LatentAttention, LatentCache, MlaDims
from specgen.models.protocol import TargetShape

LAYER_PREFIXES = ("midlayer.", "layers.0.")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSettings
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool = False
    mla: MlaDims | None = None        # MLA attention (config has kv_lora_rank), else GQA

    @classmethod
    def from_hf(cls, config: dict, *, target_layers: int, target_hidden: int,
                target_vocab: int, fit: TargetFit | None = None) -> Eagle3Config:
        layers = int(config.get("num_hidden_layers", 1))
        if layers != 1:
            raise ValueError(f"num_hidden_layers is {layers}; only single-layer EAGLE-3 drafts are supported")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        vocab = int(config.get("vocab_size") or target_vocab)
        TargetFit.require(fit, "vocabulary", vocab == target_vocab,
                          f"vocab_size {vocab} differs from the target's {target_vocab}", f"{vocab} tokens")
        eagle = config.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get("eagle_aux_hidden_state_layer_ids")
        ids = tuple(int(i) for i in ids) if ids else default_aux_layer_ids(target_layers)
        TargetFit.require(fit, "layer ids", all(0 <= i < target_layers for i in ids),
                          f"aux layer ids {list(ids)} are outside the target's {target_layers} layers",
                          f"reads target layers {list(ids)} of {target_layers}")
        target_h = int(config.get("target_hidden_size") or hidden)
        TargetFit.require(fit, "hidden size", target_h == target_hidden,
                          f"target_hidden_size {target_h} differs from the target's {target_hidden}",
                          f"{target_h}")
        return cls(
            hidden_size=hidden,
            target_hidden_size=target_h,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=RopeSettings.from_hf(config),
            vocab_size=vocab,
            draft_vocab_size=read_draft_vocab_size(config, vocab),
            aux_layer_ids=ids,
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            mla=MlaDims.from_hf(config) if config.get("kv_lora_rank") else None,
        )

    @property
    def rope_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def num_parameters(self, tensors: frozenset[str] = frozenset()) -> int:
        """Parameters, given the checkpoint's tensor names (an own `embed_tokens` counts too)."""
        own_embedding = "embed_tokens.weight" in tensors
        h, d = self.hidden_size, self.head_dim
        attn = 2 * h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h
        if self.mla is not None:
            attn = self.mla.parameters(2 * h, h)
        layer = attn + 3 * h * self.intermediate_size + 3 * h
        embed = self.vocab_size * h if own_embedding else 0
        return (layer + len(self.aux_layer_ids) * self.target_hidden_size * h + h
                + self.draft_vocab_size * h + embed)

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        if self.mla is not None:
            return LatentCache.bytes_per_token(1, self.mla.latent_dim, dtype)
        return KVCache.bytes_per_token(1, self.num_kv_heads, self.head_dim, dtype)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        if cfg.mla is not None:
            self.self_attn = LatentAttention(2 * h, h, cfg.mla)
        else:
            self.self_attn = CachedSelfAttention(2 * h, h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size)
        self.norm_before_residual = cfg.norm_before_residual

    def forward(self, emb, feature, cos, sin, attention: Attention):
        # emb, feature: [B, T, H] -> [B, T, H] (pre-norm output, fed back as the next feature)
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat((self.input_layernorm(emb), normed), dim=-1)  # embedding first
        h = residual + attention(self.self_attn, x, cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: Eagle3Config, num_speculative_tokens: int, target, own_embedding: bool) -> None:
        super().__init__()
        self.config = cfg
        self.aux_layer_ids = cfg.aux_layer_ids
        self.num_speculative_tokens = num_speculative_tokens
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        # Held outside the module tree: the target's weights are neither saved nor loaded here.
        self._target = (target,)
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size), persistent=False)
        self.rope_scale = cfg.rope.attention_factor()
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope_dim, cfg.rope), persistent=False)

    def init_buffers(self, device) -> None:
        self.draft_to_target = torch.arange(self.config.draft_vocab_size, device=device)
        self.inv_freq = rope_inv_freq(self.config.rope_dim, self.config.rope).to(device)

    @property
    def reduced_vocab(self) -> bool:
        return self.config.draft_vocab_size != self.config.vocab_size

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens) if self.embed_tokens is not None else self._target[0].embed(tokens)

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device) -> KVCache | LatentCache:
        c = self.config
        if c.mla is not None:
            return LatentCache(1, slots, max_len, c.mla.latent_dim, dtype, device)
        return KVCache(1, slots, c.num_kv_heads, max_len, c.head_dim, dtype, device)

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        # [B, Vd] -> [B, V]; tokens outside the draft vocabulary can never be drafted (-inf).
        if not self.reduced_vocab:
            return draft_logits
        return to_target_logits(draft_logits, self.draft_to_target, self.config.vocab_size)

    def first_feature(self, aux: torch.Tensor) -> torch.Tensor:
        # aux: [B, T, 3 * H_target] low|mid|high -> the first pass's feature [B, T, H]
        return self.fc(aux)

    def pass_with(self, feature, tokens, positions, attention: Attention):
        # feature: [B, T, H]; tokens, positions: [B, T] -> pre-norm hidden [B, T, H]
        cos, sin = rope_cos_sin(positions, self.inv_freq, feature.dtype, self.rope_scale)
        return self.layer(self.embed(tokens), feature, cos, sin, attention)

    def _pass(self, feature, tokens, cache, attn: AttentionBatch):
        return self.pass_with(feature, tokens, attn.positions, cached(cache, 0, attn))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] pre-norm -> logits [..., Vd] (float32) over the DRAFT vocabulary
        return float32_logits(self.norm(hidden), self.lm_head.weight)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, H] pre-norm -> logits [B, V] (float32) over the target vocabulary
        return self.target_logits(self.draft_logits(hidden))

    def propose(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                last_index: torch.Tensor, cache, attn: AttentionBatch, pick: Pick,
                k: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # aux: [B, T, 3 * H_target]; next_tokens (token at p + 1), positions (p): [B, T]; last_index: [B]
        # returns tokens [B, k] and their probabilities [B, k, V] (None for argmax drafts); k defaults
        # to num_speculative_tokens
        k = self.num_speculative_tokens if k is None else k
        return chain_propose(self, self.first_feature(aux), next_tokens, last_index, cache, attn, pick, k)


def convert_eagle3_state_dict(state: dict[str, torch.Tensor], cfg: Eagle3Config,
                              where: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Checkpoint keys -> ours. Returns the weights and the draft->target id map (None = identity)."""
    prefix = next((p for p in LAYER_PREFIXES if any(k.startswith(p) for k in state)), None)
    if prefix is None:
        raise CheckpointError(f"{where}: no EAGLE-3 decoder layer (keys under midlayer.* or layers.0.*)")
    out = {("layer." + key[len(prefix):] if key.startswith(prefix) else key): tensor
           for key, tensor in state.items()}
    mapping = take_d2t(out, cfg.draft_vocab_size, cfg.vocab_size, where)
    fuse_attention_and_mlp_keys(out, "layer.")
    return out, mapping


def dummy_eagle3_config(t: TargetShape) -> dict:
    """An EAGLE-3 config in the target's shape (full vocabulary), for random-init demo drafts."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope.theta,
        "vocab_size": t.vocab_size, "draft_vocab_size": t.vocab_size,
    }


def build_eagle3_draft(config: dict, state: dict[str, torch.Tensor] | None, target, *,
                       num_speculative_tokens: int, dtype: torch.dtype, device, seed: int = 0,
                       where: str = "draft") -> Eagle3Draft:
    """The draft for `target` from its HF config and tensors (None = random weights)."""
    cfg = read_draft_config(Eagle3Config, config, target, where, "EAGLE-3")
    mapping = None
    if state is not None:
        state, mapping = convert_eagle3_state_dict(state, cfg, where)
    own_embedding = state is not None and "embed_tokens.weight" in state
    if not own_embedding and cfg.hidden_size != target.hidden_size:
        raise CheckpointError(f"{where}: the draft has no embed_tokens.weight, so it shares the target's "
                              f"embedding, but its hidden_size {cfg.hidden_size} differs from the "
                              f"target's {target.hidden_size}")
    draft = build(lambda: Eagle3Draft(cfg, num_speculative_tokens, target, own_embedding), state,
                  dtype=dtype, device=device, seed=seed, where=where)
    if mapping is not None:
        draft.draft_to_target = mapping.to(device)
    return draft


METHOD = DraftBuilder(Eagle3Config, build_eagle3_draft, dummy_eagle3_config)
