"""What differs between draft methods when training: a fresh config, the loss, the exported layout.

Contract: `TRAINERS[method]` is a `MethodTrainer` with
- `new_config(shape, spec, token_counts, unused_ids) -> (hf_config, extra)`: the draft's HF config
  in the target's shape (`extra` holds tensors the config implies: the draft vocabulary's map;
  `token_counts` [V]: answer-token frequencies; `unused_ids`: rows no training sequence contains,
  best mask token first, `mask_candidates`);
- `build(config, extra, target, k, state=None) -> draft`: fp32 trainable weights, random or (a
  warm start) `state`, a trained draft's tensors in its checkpoint layout, vocabulary map included;
  via the same builders `specgen run` loads with (drafts/*.py), so training and inference share one
  module;
- `loss(draft, aux, tokens, scored, spec, generator, teacher=None) -> (loss, correct [P], count
  [P])`: the method's objective and its per-position top-1 agreement (P = unrolled steps or block
  positions); `teacher` [B, T, Vd], the target's distribution over the draft vocabulary at each
  position, makes the labels soft with weight `spec.soft_labels` (training/soft_labels.py);
- `export(draft, config, extra) -> tensors`: the state in the published layout its loader reads
  (EAGLE-3: `midlayer.*`; DFlash: z-lab's keys; MTP: `model.layers.{N}.*`; each with `d2t`/`t2d`
  when its vocabulary is reduced);
- `head_rows_chosen`: True where the reduced head is rows of a full head that is not trained
  (DFlash, MTP): a warm start may choose its vocabulary again from its own run's answers, losing
  no trained weight; EAGLE-3's head holds only its trained rows, so a warm start keeps them.

Every method drafts from a reduced vocabulary of the `draft_vocab_size` most frequent answer tokens
(drafts/vocab.py: `d2t[i] = target_id - i`, `t2d[target_id]` = in the draft vocabulary), which
takes the full-vocabulary head out of every drafted position; a label outside it is left out of the
loss (it can never be drafted) and counts as a miss in the agreement. EAGLE-3 trains a head of its own over it; DFlash and MTP score with the target's
head, restricted to those rows (frozen, as the references share it).

Methods (each as its reference trains it):
- EAGLE-3: training-time test over `ttt_steps` unrolled passes (training/unroll.py), weights
  `ttt_decay ** i`.
- DFlash: random anchors, `[anchor, MASK x K]` blocks under the inference mask, position-decayed
  cross-entropy (training/blocks.py). The mask token is `train.mask_token_id`, else a row that means
  nothing (`mask_candidates`: the references use an unused row or a special token; an ordinary
  subword's embedding, which the draft reads through the target's, is a word to it); it reads
  `train.feature_layers` target layers (default 5, as the published drafts do), spread as z-lab
  spreads them.
- MTP: the next-next-token loss (feature of t, token t + 1, predicts t + 2), and the same loss on
  `ttt_steps - 1` further unrolled passes, since specgen chains the one layer K times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specgen.drafts import dflash, eagle3, mtp
from specgen.drafts.vocab import d2t_tensors, label_map, most_frequent
from specgen.models.layers import split_attention_and_mlp_keys
from specgen.models.protocol import TargetShape
from specgen.training.blocks import block_loss, default_gamma, sample_anchors
from specgen.training.unroll import unrolled_chain


@dataclass(frozen=True, slots=True)
class MethodTrainer:
    new_config: Callable[..., tuple[dict, dict]]
    build: Callable[..., torch.nn.Module]
    loss: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    export: Callable[..., dict[str, torch.Tensor]]
    head_rows_chosen: bool


def _built(builder, config: dict, state: dict | None, target, k: int):
    # fp32 weights (the optimizer's copy), on the target's device: random, or a trained draft's
    draft = builder(config, state, target, num_speculative_tokens=k, dtype=torch.float32,
                    device=target.input_embedding.device, seed=0,
                    where="new draft" if state is None else "train.init_from")
    return draft.train().requires_grad_(True)


def draft_vocabulary(shape: TargetShape, spec, token_counts: torch.Tensor) -> tuple[dict, dict]:
    """The config entry and the `extra` map of a reduced draft vocabulary (none when
    `draft_vocab_size` covers the target's)."""
    size = min(spec.draft_vocab_size, shape.vocab_size)
    if size == shape.vocab_size:
        return {}, {}
    return {"draft_vocab_size": size}, {"draft_to_target": most_frequent(token_counts, size)}


def rechosen_vocabulary(config: dict, state: dict, shape: TargetShape, spec,
                        token_counts: torch.Tensor) -> tuple[dict, dict]:
    """A warm start's config and tensors (in place) with the vocabulary chosen again from this run's
    answer-token frequencies, for a method whose head rows are gathered from a full head."""
    vocab, extra = draft_vocabulary(shape, spec, token_counts)
    config = {k: v for k, v in config.items() if k != "draft_vocab_size"} | vocab
    state.pop("d2t", None)
    state.pop("t2d", None)
    if extra:
        state.update(d2t_tensors(extra["draft_to_target"], shape.vocab_size))
    return config, extra


def _with_vocabulary(draft, extra: dict):
    if "draft_to_target" in extra:
        draft.select_vocabulary(extra["draft_to_target"])
    return draft


def labels_of(draft) -> torch.Tensor | None:
    """[V] target id -> draft id (-1 outside) for a reduced vocabulary; None for the full one."""
    if not draft.reduced_vocab:
        return None
    return label_map(draft.draft_to_target, draft.config.vocab_size)


def _vocab_export(draft) -> dict[str, torch.Tensor]:
    return d2t_tensors(draft.draft_to_target, draft.config.vocab_size) if draft.reduced_vocab else {}


def _chain_loss(draft, aux, tokens, scored, spec, generator, teacher=None):
    steps = unrolled_chain(draft, aux, tokens, scored, spec.ttt_steps, labels_of(draft), teacher, spec.soft_labels)
    loss = sum(spec.ttt_decay ** i * s.loss for i, s in enumerate(steps)) / sum(
        spec.ttt_decay ** i for i in range(len(steps)))
    return loss, torch.stack([s.correct for s in steps]), torch.stack([s.count for s in steps])


def _layer_keys(state: dict[str, torch.Tensor], prefix: str, heads: int, kv_heads: int, head_dim: int) -> None:
    split_attention_and_mlp_keys(state, prefix, heads * head_dim, kv_heads * head_dim)


# ------------------------------------------------------------------------------------------ EAGLE-3


def _eagle3_config(shape: TargetShape, spec, token_counts: torch.Tensor, unused_ids=()) -> tuple[dict, dict]:
    config = eagle3.dummy_eagle3_config(shape)
    vocab, extra = draft_vocabulary(shape, spec, token_counts)
    config.update({**vocab, "target_hidden_size": shape.hidden_size,
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                    list(eagle3.default_aux_layer_ids(shape.num_layers))}})
    if spec.head_init == "target":
        extra["head_from_target"] = True
    return config, extra


def _eagle3_build(config: dict, extra: dict, target, k: int, state: dict | None = None):
    draft = _built(eagle3.build_eagle3_draft, config, state, target, k)
    if "draft_to_target" in extra:      # EAGLE-3's own head is already Vd rows: only the map changes
        draft.draft_to_target = extra["draft_to_target"].to(target.input_embedding.device)
    if state is None and extra.get("head_from_target"):
        # a new head starts as the target's rows for the draft vocabulary (trained from there): the
        # draft's hidden size is the target's, and the target's head already separates these tokens
        rows = target.output_embedding.detach()
        with torch.no_grad():
            draft.lm_head.weight.copy_(rows[draft.draft_to_target] if draft.reduced_vocab else rows)
    return draft


def _eagle3_export(draft, config: dict, extra: dict) -> dict[str, torch.Tensor]:
    c = draft.config
    state = {("midlayer." + k[len("layer."):] if k.startswith("layer.") else k): v
             for k, v in draft.state_dict().items()}
    _layer_keys(state, "midlayer.", c.num_heads, c.num_kv_heads, c.head_dim)
    return {**state, **_vocab_export(draft)}


# ------------------------------------------------------------------------------------------- DFlash


DFLASH_FEATURE_LAYERS = 5     # target layers a DFlash draft reads by default (z-lab's published drafts)


def mask_candidates(tokenizer, vocab_size: int, sequences: list[list[int]]) -> tuple[int, ...]:
    """Rows a DFlash mask token can take that mean nothing to the target, best first: embedding rows
    past the tokenizer's vocabulary (never produced; z-lab's Qwen3 drafts use the first, 151669), then
    the tokenizer's special tokens that no training sequence (prompt or answer) contains, highest id
    first (reserved tokens come last: Llama-3's `<|reserved_special_token_*|>`, SmolLM2's
    `<empty_output>`, id 16)."""
    size = min(len(tokenizer), vocab_size) if hasattr(tokenizer, "__len__") else vocab_size
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    special = {int(i) for i, token in added.items() if getattr(token, "special", False)}
    special |= set(getattr(tokenizer, "all_special_ids", ()) or ())
    seen = set()
    for ids in sequences:
        seen.update(ids)
    quiet = sorted((i for i in special if 0 <= i < size and i not in seen), reverse=True)
    return tuple(range(size, vocab_size)) + tuple(quiet)


def _dflash_config(shape: TargetShape, spec, token_counts: torch.Tensor, unused_ids=()) -> tuple[dict, dict]:
    config = dflash.dummy_dflash_config(shape)
    layers = spec.layers
    config.update({"num_hidden_layers": layers, "block_size": spec.block_size,
                   "layer_types": ["full_attention"] * layers})
    if spec.mask_token_id is not None:
        mask = spec.mask_token_id
    else:
        mask = unused_ids[0] if unused_ids else shape.vocab_size - 1
    features = min(spec.feature_layers or DFLASH_FEATURE_LAYERS, shape.num_layers)
    config["dflash_config"] = {
        "mask_token_id": int(mask),
        # distinct: a shallow target has fewer layers between 1 and L - 3 than features asked
        "target_layer_ids": sorted(set(dflash.default_target_layer_ids(shape.num_layers, features))),
    }
    vocab, extra = draft_vocabulary(shape, spec, token_counts)
    config.update(vocab)
    return config, extra


def _dflash_build(config: dict, extra: dict, target, k: int, state: dict | None = None):
    return _with_vocabulary(_built(dflash.build_dflash_draft, config, state, target, k), extra)


def _dflash_loss(draft, aux, tokens, scored, spec, generator, teacher=None):
    anchors, keep = sample_anchors(scored, spec.anchors, generator)
    gamma = spec.loss_gamma if spec.loss_gamma is not None else default_gamma(spec.block_size)
    return block_loss(draft, aux, tokens, scored, anchors, keep, gamma, labels_of(draft), teacher, spec.soft_labels)


def _dflash_export(draft, config: dict, extra: dict) -> dict[str, torch.Tensor]:
    c = draft.config
    state = dict(draft.state_dict())
    for i in range(c.num_layers):
        _layer_keys(state, f"layers.{i}.", c.num_heads, c.num_kv_heads, c.head_dim)
    return {**state, **_vocab_export(draft)}


# ---------------------------------------------------------------------------------------------- MTP


def _mtp_config(shape: TargetShape, spec, token_counts: torch.Tensor, unused_ids=()) -> tuple[dict, dict]:
    vocab, extra = draft_vocabulary(shape, spec, token_counts)
    return {**mtp.dummy_mtp_config(shape), **vocab}, extra


def _mtp_build(config: dict, extra: dict, target, k: int, state: dict | None = None):
    return _with_vocabulary(_built(mtp.build_mtp_draft, config, state, target, k), extra)


def _mtp_export(draft, config: dict, extra: dict) -> dict[str, torch.Tensor]:
    block = draft.config.block
    prefix = mtp.mtp_weight_prefix(config)
    state = {(prefix + k[len("block."):] if k.startswith("block.") else prefix + k): v
             for k, v in draft.state_dict().items()}
    _layer_keys(state, prefix, block.num_heads, block.num_kv_heads, block.head_dim)
    return {**state, **{prefix + k: v for k, v in _vocab_export(draft).items()}}


TRAINERS: dict[str, MethodTrainer] = {
    "eagle3": MethodTrainer(_eagle3_config, _eagle3_build, _chain_loss, _eagle3_export, head_rows_chosen=False),
    "dflash": MethodTrainer(_dflash_config, _dflash_build, _dflash_loss, _dflash_export, head_rows_chosen=True),
    "mtp": MethodTrainer(_mtp_config, _mtp_build, _chain_loss, _mtp_export, head_rows_chosen=True),
}
