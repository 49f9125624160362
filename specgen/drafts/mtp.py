"""MTP draft (DeepSeek-V3 multi-token prediction module), drafted as a chain.

Contract: the `Draft` interface of drafts/base.py. One pass of the module over entry j (feature of
position p_j, token t at p_j + 1, draft-cache entry at p_j, predicts the token at p_j + 2):

    x = eh_proj(cat(enorm(embed(t)), hnorm(h)))     # embedding FIRST, as the checkpoints and engines do
    o = block(x)                                     # a full decoder layer with its own 1-layer KV cache
    logits = shared_head.head(shared_head.norm(o))

K > 1 reuses the one layer K times (drafts/chain.py): the pre-norm output `o` is the next feature.

Which target hidden state `h` is: the target's last hidden state AFTER its final norm (`model.norm`).
- DeepSeek-V3 `inference/model.py` (`Transformer.forward`) has no MTP module at all (`convert.py` skips
  `model.layers.61`); the only last hidden state it forms is `self.norm(h)`, fed to the head.
- vLLM `vllm/v1/worker/gpu_model_runner.py` (`propose_draft_token_ids`) passes the target model's
  output `hidden_states` as `target_hidden_states` to the proposer (`vllm/v1/spec_decode/eagle.py`,
  `propose`) for MTP (aux states are only used by EAGLE-3); that output is what
  `DeepseekV2Model.forward` returns after `hidden_states, _ = self.norm(hidden_states, residual)`.
  `DeepSeekMultiTokenPredictorLayer.forward` (`vllm/model_executor/models/deepseek_mtp.py`) then
  applies `hnorm` to it and returns `residual + hidden_states` (pre `shared_head.norm`), which the
  proposer feeds back for the next step; `compute_logits` applies `shared_head.norm` then the head.
So the draft captures layer output L-1 (the last layer's output BEFORE the final norm, DESIGN.md
section 5) and applies the target's own `model.norm` to it. vLLM also zeroes the embedding of the
entry at position 0; we do not (it only touches the first prompt entry, and the DeepSeek report's
formula has no such rule): draft quality only, never losslessness.

Checkpoint layout (README_WEIGHTS.md of DeepSeek-V3, ALGORITHMS.md section 3.2): the layer sits at
`model.layers.{N}.*` with N = `num_hidden_layers` (`METHOD.weight_prefix`), either inside the target
checkpoint (then `config` is the target's config.json) or in a separate folder with the same key
names and its own config.json; the loader hands this module the tensors under that prefix.
Only `num_nextn_predict_layers` == 1 is supported. `embed_tokens` and `shared_head.head` are optional:
absent (or equal to the target's, as DeepSeek stores duplicates) they are shared with the target.
A reduced draft vocabulary (specgen's extension, drafts/vocab.py): `draft_vocab_size` in the config
and `d2t` / `t2d` under the layer's prefix; the head is then the `d2t` rows of the full head (the
shared one or its own), gathered at load, so each chained pass pays Vd rows instead of V. A loader
without the extension ignores both and scores the full vocabulary with the same weights (slower;
it may draft other tokens).

The block is pluggable (`MTP_BLOCKS`, keyed by `model_type`): a block module exposes
`decode(h [B, T, H], positions [B, T], attention) -> [B, T, H]` (`attention` binds the keys:
a KV cache at inference, models/layers.py `cached`), `new_cache` and
`init_buffers(device)`; an adapter rewrites its checkpoint keys. Two blocks: the Llama decoder
layer, and DeepSeek-V3's (MLA with its own one-layer latent cache, MoE MLP: layer N is past
`first_k_dense_replace`), read from `model.layers.61.*` of the DeepSeek-V3 checkpoint itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from specgen.drafts.base import DraftBuilder, Pick, TargetFit, read_draft_config
from specgen.drafts.chain import chain_propose
from specgen.drafts.vocab import HeadRows, read_draft_vocab_size, take_d2t
from specgen.models.attention import AttentionBatch, KVCache
from specgen.models.layers import (
    Attention,
    RMSNorm,
    cached,
    float32_logits,
    fuse_attention_and_mlp_keys,
    rope_cos_sin,
    rope_inv_freq,
)
from specgen.models.deepseek_v3 import DeepseekV3Config, DeepseekV3DecoderLayer, adapt_layer_keys
from specgen.models.llama import LlamaConfig, LlamaDecoderLayer
from specgen.models.mla import LatentCache
from specgen.models.materialise import build
from specgen.models.protocol import TargetShape
from specgen.models.tensor_header import TensorHeader

# ------------------------------------------------------------------------------------------ blocks


class LlamaMtpBlock(LlamaDecoderLayer):
    """The Llama decoder layer as an MTP block: its own RoPE (the config's) and a 1-layer KV cache."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        self.config = cfg
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope), persistent=False)

    def init_buffers(self, device) -> None:
        self.inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope).to(device)

    def decode(self, h, positions, attention: Attention):
        # h: [B, T, H] at positions [B, T] -> [B, T, H]
        cos, sin = rope_cos_sin(positions, self.inv_freq, h.dtype)
        return self.residual(h, cos, sin, attention)

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        c = self.config
        return KVCache(1, slots, c.num_kv_heads, max_len, c.head_dim, dtype, device)


class DeepseekMtpBlock(DeepseekV3DecoderLayer):
    """DeepSeek-V3's decoder layer N (MLA + MoE) as an MTP block, with a 1-layer latent cache."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__(cfg, cfg.num_layers)
        self.config = cfg
        self.rope_scale = cfg.mla.rope.attention_factor()
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return rope_inv_freq(self.config.mla.qk_rope_head_dim, self.config.mla.rope)

    def init_buffers(self, device) -> None:
        self.inv_freq = self._inv_freq().to(device)

    def decode(self, h, positions, attention: Attention):
        # h: [B, T, H] at positions [B, T] -> [B, T, H]
        cos, sin = rope_cos_sin(positions, self.inv_freq, h.dtype, self.rope_scale)
        return self.residual(h, cos, sin, attention)

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device) -> LatentCache:
        return LatentCache(1, slots, max_len, self.config.mla.latent_dim, dtype, device)


@dataclass(frozen=True, slots=True)
class BlockKind:
    read_config: Callable[[dict], Any]              # HF config -> block config
    build: Callable[[Any], nn.Module]               # block config -> module
    adapt_keys: Callable[[dict, str, Any], None]    # rewrite checkpoint keys under a prefix, in place
    num_parameters: Callable[[Any], int]            # block config -> parameters
    cache_bytes_per_token: Callable[[Any, torch.dtype], int]     # block config, dtype -> bytes


def _one_llama_layer_cache(cfg: LlamaConfig, dtype: torch.dtype) -> int:
    return KVCache.bytes_per_token(1, cfg.num_kv_heads, cfg.head_dim, dtype)


_DEEPSEEK_BLOCK = BlockKind(
    DeepseekV3Config.from_hf, DeepseekMtpBlock,
    lambda state, prefix, cfg: adapt_layer_keys(state, prefix, cfg.moe.n_routed_experts),
    lambda cfg: cfg.layer_parameters(cfg.num_layers),
    lambda cfg, dtype: LatentCache.bytes_per_token(1, cfg.mla.latent_dim, dtype))

# model_type -> block
MTP_BLOCKS: dict[str, BlockKind] = {
    "llama": BlockKind(LlamaConfig.from_hf, LlamaMtpBlock,
                       lambda state, prefix, cfg: fuse_attention_and_mlp_keys(state, prefix),
                       LlamaConfig.layer_parameters, _one_llama_layer_cache),
    "deepseek_v3": _DEEPSEEK_BLOCK,
    "kimi_k2": _DEEPSEEK_BLOCK,
}


def block_type(config: dict) -> str:
    model_type = config.get("model_type")
    if not model_type and any("Llama" in a for a in config.get("architectures") or []):
        model_type = "llama"
    if model_type not in MTP_BLOCKS:
        raise ValueError(f"MTP block for model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(MTP_BLOCKS)})")
    return model_type


# ------------------------------------------------------------------------------------------ config


@dataclass(frozen=True, slots=True)
class MtpConfig:
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    layer_index: int                  # N: the layer lives at model.layers.{N}.*
    aux_layer_ids: tuple[int, ...]    # (L_target - 1,): the last layer's output, before the final norm
    block_type: str
    block: Any                        # the block's own config (LlamaConfig for "llama")
    draft_vocab_size: int             # < vocab_size: the head's d2t rows only

    @classmethod
    def from_hf(cls, config: dict, *, target_layers: int, target_hidden: int,
                target_vocab: int, fit: TargetFit | None = None) -> MtpConfig:
        nextn = int(config.get("num_nextn_predict_layers", 1))
        if nextn != 1:
            raise ValueError(f"num_nextn_predict_layers is {nextn}; only one MTP layer is supported")
        hidden = int(config["hidden_size"])
        TargetFit.require(fit, "hidden size", hidden == target_hidden,
                          f"hidden_size {hidden} differs from the target's {target_hidden}", f"{hidden}")
        vocab = int(config.get("vocab_size") or target_vocab)
        TargetFit.require(fit, "vocabulary", vocab == target_vocab,
                          f"vocab_size {vocab} differs from the target's {target_vocab}", f"{vocab} tokens")
        kind = block_type(config)
        return cls(
            hidden_size=hidden,
            vocab_size=vocab,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            layer_index=int(config["num_hidden_layers"]),
            aux_layer_ids=(target_layers - 1,),
            block_type=kind,
            block=MTP_BLOCKS[kind].read_config(config),
            draft_vocab_size=read_draft_vocab_size(config, vocab),
        )

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return MTP_BLOCKS[self.block_type].cache_bytes_per_token(self.block, dtype)

    def num_parameters(self, tensors: frozenset[str] = frozenset()) -> int:
        """Parameters, given the checkpoint's tensor names under the layer's prefix (an embedding or
        head of its own counts too; DeepSeek's copies of the target's are shared at load, an
        estimate from names alone counts them)."""
        h, v = self.hidden_size, self.vocab_size
        own = v * h * (("embed_tokens.weight" in tensors) + ("shared_head.head.weight" in tensors))
        # enorm + hnorm + eh_proj + shared_head.norm + block
        return 3 * h + 2 * h * h + MTP_BLOCKS[self.block_type].num_parameters(self.block) + own


# ------------------------------------------------------------------------------------------- draft


class SharedHead(nn.Module):
    def __init__(self, cfg: MtpConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if own_head else None


class MtpDraft(HeadRows, nn.Module):
    """The MTP module over any block; the target's embedding, head and final norm are shared (the
    target is held outside the module tree, so they are neither saved nor loaded as draft weights)."""

    def __init__(self, cfg: MtpConfig, block: nn.Module, num_speculative_tokens: int, target, *,
                 own_embedding: bool, own_head: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.aux_layer_ids = cfg.aux_layer_ids
        self.num_speculative_tokens = num_speculative_tokens
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = block
        self.shared_head = SharedHead(cfg, own_head)
        self._target = (target,)
        self._register_head_rows()

    def init_buffers(self, device) -> None:
        self.block.init_buffers(device)
        self._init_head_rows(device)

    def full_head(self) -> tuple[torch.Tensor, torch.dtype]:
        own = self.shared_head.head
        return (own.weight if own is not None else self._target[0].output_embedding), self.eh_proj.weight.dtype

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens) if self.embed_tokens is not None else self._target[0].embed(tokens)

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device):
        return self.block.new_cache(slots, max_len, dtype, device)

    def first_feature(self, aux: torch.Tensor) -> torch.Tensor:
        # aux: [B, T, H] the target's last layer output -> after the target's final norm (docstring)
        return self._target[0].final_norm(aux)

    def pass_with(self, feature, tokens, positions, attention: Attention):
        # feature: [B, T, H]; tokens, positions: [B, T] -> pre-norm block output [B, T, H]
        x = self.eh_proj(torch.cat((self.enorm(self.embed(tokens)), self.hnorm(feature)), -1))
        return self.block.decode(x, positions, attention)

    def _pass(self, feature, tokens, cache, attn: AttentionBatch):
        return self.pass_with(feature, tokens, attn.positions, cached(cache, 0, attn))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> [..., Vd] float32 over the draft vocabulary
        normed = self.shared_head.norm(hidden)
        if self.reduced_vocab:
            return float32_logits(normed, self.head_rows)
        if self.shared_head.head is None:
            return self._target[0].head(normed)
        return float32_logits(normed, self.shared_head.head.weight)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [B, H] -> [B, V] float32 over the target vocabulary (-inf outside the draft's)
        return self.to_target(self.draft_logits(hidden))

    def propose(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                last_index: torch.Tensor, cache, attn: AttentionBatch, pick: Pick,
                k: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # aux: [B, T, H] the target's last layer output (pre final norm); next_tokens, positions: [B, T]
        # returns tokens [B, k] and their probabilities [B, k, V] (None for argmax drafts); k defaults
        # to num_speculative_tokens
        k = self.num_speculative_tokens if k is None else k
        return chain_propose(self, self.first_feature(aux), next_tokens, last_index, cache, attn, pick, k)


# ----------------------------------------------------------------------------------------- loading


def convert_mtp_state_dict(state: dict[str, torch.Tensor], cfg: MtpConfig) -> dict[str, torch.Tensor]:
    """Keys under model.layers.{N}. (prefix stripped) -> ours: the block's keys go under `block.`."""
    own = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
    out = {(k if k.startswith(own) else "block." + k): v for k, v in state.items()}
    MTP_BLOCKS[cfg.block_type].adapt_keys(out, "block.", cfg.block)
    return out


def _drop_duplicate(state: dict, key: str, shared: torch.Tensor, dtype: torch.dtype) -> None:
    """DeepSeek stores the shared embedding / head again in the MTP layer: share, don't copy."""
    tensor = state.get(key)
    if isinstance(tensor, TensorHeader):      # a dry load cannot compare values: DeepSeek's always match
        if tensor.shape == shared.shape:
            del state[key]
        return
    if tensor is not None and tensor.shape == shared.shape and torch.equal(
            tensor.to(device=shared.device, dtype=dtype), shared):
        del state[key]


def dummy_mtp_config(t: TargetShape) -> dict:
    """A one-layer MTP config in the target's shape (Llama block), for random-init demo drafts."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": t.num_layers, "num_nextn_predict_layers": 1,
        "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope.theta,
        "vocab_size": t.vocab_size,
    }
    if t.rope.rope_type != "default":
        config["rope_scaling"] = {"rope_type": t.rope.rope_type, **t.rope.params}
    return config


def mtp_weight_prefix(config: dict) -> str:
    """The MTP layer's tensors: `model.layers.{num_hidden_layers}.*`."""
    return f"model.layers.{int(config['num_hidden_layers'])}."


def build_mtp_draft(config: dict, state: dict[str, torch.Tensor] | None, target, *,
                    num_speculative_tokens: int, dtype: torch.dtype, device, seed: int = 0,
                    where: str = "draft") -> MtpDraft:
    """The MTP draft for `target` from `config` (the draft folder's, or the target's own when the layer
    sits inside the target checkpoint) and the tensors under `mtp_weight_prefix` (prefix stripped;
    None = random weights)."""
    cfg = read_draft_config(MtpConfig, config, target, where, "MTP")
    mapping = None
    if state is not None:
        state = dict(state)
        mapping = take_d2t(state, cfg.draft_vocab_size, cfg.vocab_size, where)
        state = convert_mtp_state_dict(state, cfg)
        _drop_duplicate(state, "embed_tokens.weight", target.input_embedding, dtype)
        _drop_duplicate(state, "shared_head.head.weight", target.output_embedding, dtype)
    own_embedding = state is not None and "embed_tokens.weight" in state
    own_head = state is not None and "shared_head.head.weight" in state
    draft = build(lambda: MtpDraft(cfg, MTP_BLOCKS[cfg.block_type].build(cfg.block), num_speculative_tokens,
                                   target, own_embedding=own_embedding, own_head=own_head),
                  state, dtype=dtype, device=device, seed=seed, where=where)
    if mapping is not None:
        draft.select_vocabulary(mapping)
    return draft


METHOD = DraftBuilder(MtpConfig, build_mtp_draft, dummy_mtp_config, mtp_weight_prefix)
