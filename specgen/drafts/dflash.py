"""DFlash draft: one non-causal pass over a block [anchor, MASK x K] conditioned on target features.

What DFlash is (z-lab/dflash `dflash/model.py`; ALGORITHMS.md section 1). The target's hidden states
after the layers in `target_layer_ids` (layer OUTPUT ids, HF `hidden_states[id + 1]`) are concatenated
per position and fused once: `ctx = hidden_norm(fc(features))`. Every draft layer is a Qwen3 decoder
layer whose attention takes Q from the block only and K/V from BOTH the context and the block, with
the SAME `k_proj` / `v_proj`, `k_norm` and RoPE (context at its real positions, the block after it).
The context enters `k_proj` / `v_proj` as `ctx` itself: `input_layernorm` only normalises the block's
hidden states (`Qwen3DFlashDecoderLayer.forward` norms `hidden_states`, not `target_hidden`).
`q_norm` / `k_norm` are per-head RMSNorms over head_dim applied before RoPE. The draft has no
embedding and no head: the block is embedded with the target's embedding, and logits are the
target's `lm_head` applied to the draft's own final `norm` output; the target's final norm is NOT
applied (`compute_logits(hidden, target.lm_head)` on `self.norm(hidden_states)`).

Conventions here:
- The anchor is the last committed token (the correction / bonus token of the previous verify), at
  `positions[b, last_index] + 1`; the block is `[anchor, MASK x K]` at anchor_pos .. anchor_pos + K.
  Block index i (1..K) predicts the token at anchor_pos + i. K may be below `block_size - 1`: the
  reference's `dflash_generate(block_size=...)` also runs shorter blocks.
- Every block query sees all context keys at positions < anchor_pos and the block bidirectionally
  (`is_causal=False`). Sliding layers (`layer_types[i] == "sliding_attention"`) follow the reference's
  `_attention_mask`: causal inside the block unless the config sets `is_causal`, and a query at q
  sees a key at k only when q - k < sliding_window (and k - q < sliding_window when non-causal).
- Context K/V live in the draft's own KVCache, one layer per draft layer, aligned with the target's
  cache: the entry for position p is at p. Each call writes all T new positions; entries past the
  committed length are scratch that the mask hides and the next step overwrites (vLLM's
  `DFlashProposer` precomputes context K/V into the draft cache the same way).
- Two attention paths, the same attention. Reference (CPU, tests): SDPA over the context keys below
  the step's key bound concatenated with the block's K/V, under `block_masks`. Kernel (CUDA, where
  the bound is the whole allocation, GPU_NOTES 5): the block's K/V are written into the cache at the
  block's positions (scratch: past the committed length) and the Triton attention kernel reads each
  row only up to what its queries see: the block's last position for a bidirectional layer, the
  query's own for a causal one. Sliding-window layers keep the reference path.
- Config: `block_size` at top level or in `dflash_config` (reference default 16);
  `dflash_config.mask_token_id` (must be a row of the target embedding); `target_layer_ids` in
  `dflash_config`, else the reference default `build_target_layer_ids(num_target_layers,
  num_hidden_layers)`: n = the draft's layer count, n == 1 -> [L // 2], otherwise n ids evenly
  spaced from 1 to L - 3, rounded (z-lab `model/dflash.py` at a3516f8).
- A reduced draft vocabulary (specgen's extension, drafts/vocab.py): `draft_vocab_size` at top level
  and `d2t` / `t2d` beside the weights. The head is then the target head's `d2t` rows, gathered at
  load, and every block position pays Vd rows instead of V; a loader without the extension ignores
  both and scores the full vocabulary with the same weights (slower; it may draft other tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specgen.drafts.base import DraftBuilder, Pick, TargetFit, read_draft_config
from specgen.drafts.vocab import HeadRows, read_draft_vocab_size, take_d2t
from specgen.kernels import attention as attention_kernel
from specgen.models.attention import AttentionBatch, KVCache, kernel_splits
from specgen.models.layers import (
    GatedMLP,
    RMSNorm,
    RopeSettings,
    apply_rope,
    float32_logits,
    fuse_attention_and_mlp_keys,
    rope_cos_sin,
    rope_inv_freq,
)
from specgen.models.materialise import build
from specgen.models.protocol import TargetShape


def default_target_layer_ids(num_target_layers: int, n: int) -> tuple[int, ...]:
    """The reference's default feature layers (outputs): n == 1 -> middle; else 1 .. L-3 evenly."""
    if n == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(int(round(start + i * (end - start) / (n - 1))) for i in range(n))


def dflash_value(config: dict, name: str, default=None):
    # The reference reads dflash_config first, then the top level (`_draft_value`).
    value = (config.get("dflash_config") or {}).get(name)
    if value is None:
        value = config.get(name)
    return default if value is None else value


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSettings
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    sliding_windows: tuple[int | None, ...]   # per layer; None = full attention
    causal: tuple[bool, ...]                  # per layer: causal inside the block
    vocab_size: int                           # the target's (the draft scores with its head)
    draft_vocab_size: int                     # < vocab_size: the head's d2t rows only
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, config: dict, *, target_layers: int, target_hidden: int,
                target_vocab: int, fit: TargetFit | None = None) -> DFlashConfig:
        layers = int(config["num_hidden_layers"])
        hidden = int(config["hidden_size"])
        TargetFit.require(fit, "hidden size", hidden == target_hidden,
                          f"hidden_size {hidden} differs from the target's {target_hidden}", f"{hidden}")
        heads = int(config["num_attention_heads"])
        block_size = int(dflash_value(config, "block_size", 16))
        if block_size < 2:
            raise ValueError(f"block_size {block_size} leaves no token to draft")
        mask = dflash_value(config, "mask_token_id")
        if mask is None:
            raise ValueError("dflash_config.mask_token_id is missing")
        mask = int(mask)
        TargetFit.require(fit, "mask token", 0 <= mask < target_vocab,
                          f"mask_token_id {mask} is not a row of the target embedding (vocab_size "
                          f"{target_vocab}); the draft has no embedding of its own",
                          f"{mask} < vocab_size {target_vocab}")
        ids = dflash_value(config, "target_layer_ids")
        if ids is None:
            stated = config.get("num_target_layers")
            TargetFit.require(fit, "target depth", stated is None or int(stated) == target_layers,
                              f"num_target_layers {stated} differs from the target's {target_layers} "
                              "and no target_layer_ids are given", f"{target_layers} layers")
            ids = default_target_layer_ids(target_layers, layers)
        ids = tuple(int(i) for i in ids)
        if not ids:
            raise ValueError("dflash_config.target_layer_ids is empty")
        TargetFit.require(fit, "layer ids", all(0 <= i < target_layers for i in ids),
                          f"target_layer_ids {list(ids)} are outside the target's {target_layers} layers",
                          f"reads target layers {list(ids)} of {target_layers}")
        types = config.get("layer_types") or ["full_attention"] * layers
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        window = config.get("sliding_window")
        is_causal = dflash_value(config, "is_causal")
        windows, causal = [], []
        for kind in types:
            if kind == "sliding_attention":
                if not window:
                    raise ValueError("a sliding_attention layer needs sliding_window")
                windows.append(int(window))
                causal.append(True if is_causal is None else bool(is_causal))
            elif kind == "full_attention":
                windows.append(None)
                causal.append(False if is_causal is None else bool(is_causal))
            else:
                raise ValueError(f"layer type {kind!r} is not supported (full_attention, sliding_attention)")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=RopeSettings.from_hf(config),
            block_size=block_size,
            mask_token_id=mask,
            target_layer_ids=ids,
            sliding_windows=tuple(windows),
            causal=tuple(causal),
            vocab_size=target_vocab,
            draft_vocab_size=read_draft_vocab_size(config, target_vocab),
            attention_bias=bool(config.get("attention_bias", False)),
        )

    def num_parameters(self, tensors: frozenset[str] = frozenset()) -> int:
        """Parameters (no embedding, no head: the target's serve)."""
        h, d, i = self.hidden_size, self.head_dim, self.intermediate_size
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        attn = h * qkv + self.num_heads * d * h + 2 * d + (qkv + h if self.attention_bias else 0)
        layer = attn + 3 * h * i + 2 * h
        return self.num_layers * layer + len(self.target_layer_ids) * h * h + 2 * h

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return KVCache.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, dtype)


class DFlashAttention(nn.Module):
    """Q from the block; K/V from the cached context and the block, with shared projections."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.heads + 2 * self.kv_heads) * self.head_dim,
                                  bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.head_dim)

    def context_kv(self, ctx, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        # ctx: [B, T, H] fused features -> their keys (k_norm, RoPE) and values [B, T, Hkv, D]
        q_rows = self.heads * self.head_dim
        bias = self.qkv_proj.bias[q_rows:] if self.qkv_proj.bias is not None else None
        # heads first, then the split (a view of a split slice specialises a dynamic length on 1)
        k, v = self._heads(F.linear(ctx, self.qkv_proj.weight[q_rows:], bias), 2 * self.kv_heads).chunk(2, dim=2)
        return apply_rope(self.k_norm(k), cos, sin), v

    def block_qkv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [B, L, H] normed block -> q [B, L, Hq, D], k and v [B, L, Hkv, D] (normed, rotated)
        q, k, v = self._heads(self.qkv_proj(x), self.heads + 2 * self.kv_heads).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=2)
        return apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin), v

    def forward(self, x, cos, sin, context_k, context_v, mask) -> torch.Tensor:
        # x: [B, L, H] normed block; context_k, context_v: [B, Hkv, kv_len, D];
        # mask: [B, 1, L, kv_len + L] -> [B, L, H]
        batch, length, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.block_qkv(x, cos, sin))
        keys = torch.cat((context_k.to(k.dtype), k), dim=2)
        values = torch.cat((context_v.to(v.dtype), v), dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def forward_cached(self, x, cos, sin, cache: KVCache, layer: int, rows, block_pos, visible,
                       splits: int) -> torch.Tensor:
        # x: [B, L, H] normed block; rows: [B] cache rows; block_pos: [B, L] the block's positions;
        # visible: [B, L] the last key position each query sees -> [B, L, H]
        batch, length, _ = x.shape
        q, k, v = self.block_qkv(x, cos, sin)
        cache.write(layer, rows, block_pos, k, v)
        out = attention_kernel.cached_attention(q, cache.k[layer], cache.v[layer], rows, visible,
                                                self.head_dim ** -0.5, splits)
        return self.o_proj(out.reshape(batch, length, -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, context_k, context_v, mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_cached(self, x, cos, sin, cache, layer, rows, block_pos, visible, splits):
        h = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, cache, layer, rows,
                                              block_pos, visible, splits)
        return h + self.mlp(self.post_attention_layernorm(h))


def block_masks(cfg: DFlashConfig, block_pos: torch.Tensor, key_index: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer masks [B, 1, L, kv_len + L] over [context keys 0..kv_len-1, block keys]."""
    # block_pos: [B, L]; key_index: [kv_len] arange; context key k is visible when k < anchor_pos.
    keys = key_index.view(1, 1, -1)
    query = block_pos.unsqueeze(-1)                                          # [B, L, 1]
    anchor = block_pos[:, :1].unsqueeze(-1)                                  # [B, 1, 1]
    context = (keys < anchor).expand(-1, block_pos.shape[1], -1)            # [B, L, kv_len]
    distance = query - block_pos.unsqueeze(1)                                # [B, L, L] q - k
    masks: dict[tuple, torch.Tensor] = {}
    out = []
    for window, causal in zip(cfg.sliding_windows, cfg.causal):
        if (window, causal) not in masks:
            ctx, blk = context, torch.ones_like(distance, dtype=torch.bool)
            if causal:
                blk = blk & (distance >= 0)
            if window is not None:
                ctx = ctx & (query - keys < window)
                blk = blk & (distance < window) & (-distance < window)
            masks[(window, causal)] = torch.cat((ctx, blk), dim=-1).unsqueeze(1)
        out.append(masks[(window, causal)])
    return out


class DFlashDraft(HeadRows, nn.Module):
    def __init__(self, cfg: DFlashConfig, num_speculative_tokens: int, target) -> None:
        super().__init__()
        self.config = cfg
        self.aux_layer_ids = cfg.target_layer_ids
        self.num_speculative_tokens = num_speculative_tokens
        self.mask_token_id = cfg.mask_token_id
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Held outside the module tree: the target's weights are neither saved nor loaded here.
        self._target = (target,)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope), persistent=False)
        self._register_head_rows()

    def init_buffers(self, device) -> None:
        self.inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope).to(device)
        self._init_head_rows(device)

    def full_head(self) -> tuple[torch.Tensor, torch.dtype]:
        return self._target[0].output_embedding, self.fc.weight.dtype

    def new_cache(self, slots: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, slots, c.num_kv_heads, max_len, c.head_dim, dtype, device)

    def block_logits(self, aux, next_tokens, positions, last_index, cache: KVCache,
                     attn: AttentionBatch, k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # aux: [B, T, n * H]; next_tokens, positions: [B, T]; last_index: [B]
        # returns logits [B, k, V] (float32) of block indices 1..k and their positions [B, k];
        # k = 0 only writes the context K/V of the T entries (the block is never run)
        k = self.num_speculative_tokens if k is None else k
        batch = aux.shape[0]
        rows = torch.arange(batch, device=aux.device)
        cache_rows = attn.cache_rows(batch, aux.device)
        ctx = self.context(aux)                                                 # [B, T, H]
        cos_c, sin_c = rope_cos_sin(positions, self.inv_freq, ctx.dtype)
        if k == 0:
            for i, layer in enumerate(self.layers):
                cache.write(i, cache_rows, positions, *layer.self_attn.context_kv(ctx, cos_c, sin_c))
            return ctx.new_zeros(batch, 0, self._target[0].vocab_size), positions[:, :0]
        anchor = next_tokens[rows, last_index]                                  # [B]
        anchor_pos = positions[rows, last_index] + 1                            # [B]
        block_pos = anchor_pos.unsqueeze(1) + torch.arange(k + 1, device=aux.device)
        x = self.embed_block(anchor.unsqueeze(1), k)                            # [B, k + 1, H]
        cos_b, sin_b = rope_cos_sin(block_pos, self.inv_freq, x.dtype)
        windows = self.config.sliding_windows
        on_kernel = [attn.use_kernel and window is None for window in windows]
        if not all(on_kernel):
            layer_masks = block_masks(self.config, block_pos, attn.key_index)
        if any(on_kernel):
            # what each query sees: a bidirectional layer the whole block, a causal one up to itself
            whole_block = block_pos[:, -1:].expand(-1, k + 1).contiguous()
            splits = kernel_splits(attn, cache.max_len)
        kv_len = attn.key_index.shape[0]
        for i, layer in enumerate(self.layers):
            # The context enters k_proj / v_proj as is (no input_layernorm), like the reference.
            cache.write(i, cache_rows, positions, *layer.self_attn.context_kv(ctx, cos_c, sin_c))
            if on_kernel[i]:
                visible = block_pos if self.config.causal[i] else whole_block
                x = layer.forward_cached(x, cos_b, sin_b, cache, i, cache_rows, block_pos, visible, splits)
                continue
            keys, values = cache.k[i][:, :, :kv_len], cache.v[i][:, :, :kv_len]
            if attn.rows is not None:
                keys, values = keys[attn.rows], values[attn.rows]
            x = layer(x, cos_b, sin_b, keys, values, layer_masks[i])
        return self.block_head(x[:, 1:]), block_pos[:, 1:]

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        # aux: [B, T, n * H] target features -> the fused context [B, T, H]
        return self.hidden_norm(self.fc(aux))

    def embed_block(self, anchors: torch.Tensor, k: int | None = None) -> torch.Tensor:
        # anchors: [B, 1] -> embedded blocks [anchor, MASK x k]: [B, k + 1, H] (k: num_speculative_tokens)
        k = self.num_speculative_tokens if k is None else k
        masks = anchors.new_full((anchors.shape[0], k), self.mask_token_id)
        return self._target[0].embed(torch.cat((anchors, masks), 1))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> [..., Vd] float32 over the draft vocabulary: the target's lm_head (its
        # d2t rows when reduced) on the draft's own norm; the target's final norm is not applied.
        if self.reduced_vocab:
            return float32_logits(self.norm(hidden), self.head_rows)
        return self._target[0].head(self.norm(hidden))

    def block_head(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., H] -> [..., V] float32 over the target vocabulary (-inf outside the draft's)
        return self.to_target(self.draft_logits(hidden))

    def propose(self, aux: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                last_index: torch.Tensor, cache: KVCache, attn: AttentionBatch, pick: Pick,
                k: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        # returns tokens [B, k] and their probabilities [B, k, V] (None for argmax drafts); k defaults
        # to num_speculative_tokens, and k = 0 only absorbs the entries (their context K/V)
        k = self.num_speculative_tokens if k is None else k
        logits, where = self.block_logits(aux, next_tokens, positions, last_index, cache, attn, k)
        if k == 0:
            return next_tokens[:, :0], None
        tokens, probs = [], []
        for i in range(k):
            token, prob = pick(logits[:, i], where[:, i])
            tokens.append(token)
            probs.append(prob)
        stacked = torch.stack(probs, 1) if probs[0] is not None else None
        return torch.stack(tokens, 1), stacked


def convert_dflash_state_dict(state: dict[str, torch.Tensor], cfg: DFlashConfig) -> dict[str, torch.Tensor]:
    """Checkpoint keys (z-lab layout, no prefix) -> ours (fused q|k|v and gate|up)."""
    out = dict(state)
    for i in range(cfg.num_layers):
        fuse_attention_and_mlp_keys(out, f"layers.{i}.")
    return out


def dummy_dflash_config(t: TargetShape) -> dict:
    """A DFlash config in the target's shape (2 layers, block 8), for random-init demo drafts."""
    layers = 2
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "num_hidden_layers": layers,
        "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope.theta,
        "vocab_size": t.vocab_size, "num_target_layers": t.num_layers, "block_size": 8,
        "layer_types": ["full_attention"] * layers,
        "dflash_config": {
            "mask_token_id": t.vocab_size - 1,
            "target_layer_ids": list(default_target_layer_ids(t.num_layers, layers)),
        },
    }


def build_dflash_draft(config: dict, state: dict[str, torch.Tensor] | None, target, *,
                       num_speculative_tokens: int | None, dtype: torch.dtype, device, seed: int = 0,
                       where: str = "draft") -> DFlashDraft:
    """The draft for `target` from its HF config and tensors (None = random weights)."""
    cfg = read_draft_config(DFlashConfig, config, target, where, "DFlash")
    k = cfg.block_size - 1 if num_speculative_tokens is None else int(num_speculative_tokens)
    if not 1 <= k <= cfg.block_size - 1:
        raise ValueError(f"num_speculative_tokens {k} must be in 1..block_size - 1 = {cfg.block_size - 1}")
    mapping = None
    if state is not None:
        state = convert_dflash_state_dict(state, cfg)
        mapping = take_d2t(state, cfg.draft_vocab_size, cfg.vocab_size, where)
    draft = build(lambda: DFlashDraft(cfg, k, target), state, dtype=dtype, device=device, seed=seed,
                  where=where)
    if mapping is not None:
        draft.select_vocabulary(mapping)
    return draft


METHOD = DraftBuilder(DFlashConfig, build_dflash_draft, dummy_dflash_config)
