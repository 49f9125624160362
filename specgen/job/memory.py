"""What a run will hold in memory, from configs alone, and the check made before weights load.

Contract: `estimate_bytes(recipe, resolved)` -> bytes by part (weights, KV caches, the workspaces of
a step and of a prefill, the CUDA graph pool, the draft's); `check_memory` raises `JobError` naming
the parts and the recipe fields to lower when they exceed 90% of what is free (device memory, or
RAM shared by the ranks on one machine); `available_bytes(device)` is what is free now. bench
sizes each configuration's runner with the same estimate (bench/measure.memory_shortfall).
"""

from __future__ import annotations

import torch

from specgen.checkpoints.gguf_blocks import published_formats
from specgen.checkpoints.loading import draft_tensor_names, kept_fp8_elements, kept_int4_parts, target_config
from specgen.job.errors import JobError
from specgen.job.resolved import (
    Resolved,
    gguf_blocks_kept,
    keeps_fp8,
    keeps_int4,
    kept_quantization,
    planned_tensor_parallel,
    shares_target_head,
)
from specgen.models.tensor_parallel import rank_shape
from specgen.recipe import Recipe
from specgen.registry import DRAFT_METHODS


def draft_config(recipe: Recipe, r: Resolved, cfg):
    """The draft's config object (from its checkpoint, or the dummy config in the target's shape)."""
    builder = DRAFT_METHODS[recipe.draft.model_method].builder()
    return builder.config_cls.from_hf(r.draft_config or builder.dummy_config(cfg.shape()),
                                      target_layers=cfg.num_layers, target_hidden=cfg.hidden_size,
                                      target_vocab=cfg.vocab_size)


def estimate_bytes(recipe: Recipe, r: Resolved) -> dict[str, int]:
    """What the run will hold, from configs alone: weights, caches, and the transients of a step and
    a prefill call (logits and their processing, attention workspace, activations; on CUDA the
    graph pool keeps the step's transients for good)."""
    # a tensor-parallel rank holds its slice of the target (its heads, KV heads, MLP rows) and its
    # cache; the draft, the embedding and the LM head are whole on every rank
    cfg = target_config(r.target_config)
    shard = rank_shape(cfg, planned_tensor_parallel(recipe))
    # block-FP8 weights kept as FP8 take a byte each, beside their float32 scales
    fp8, fp8_scales = kept_fp8_elements(r.target_config, r.target_folder) if keeps_fp8(recipe, r.device) else (0, 0)
    # split over ranks like the rest (the few whole on every rank, MLA's q_a / kv_a, are not counted)
    fp8, fp8_scales = fp8 // recipe.runtime.tensor_parallel_size, fp8_scales // recipe.runtime.tensor_parallel_size
    item = torch.empty((), dtype=r.dtype).element_size()
    # packed INT4 experts kept packed: their words and scales (a CPU repacks the scales beside a zero
    # each: torch's int4 layout), in place of dense weights; split evenly like the experts themselves
    kept_int4 = 0
    if keeps_int4(recipe, r.target_config, r.device):
        int4, words, int4_scales = kept_int4_parts(r.target_config, r.target_folder)
        kept_int4 = (int4 * item - words - int4_scales * (2 if r.device.type == "cpu" else 1)) \
            // recipe.runtime.tensor_parallel_size
    b, k, dcfg = recipe.runtime.batch_size, 0, None
    if recipe.draft.has_model:
        dcfg = draft_config(recipe, r, cfg)
        # A DFlash draft without an explicit K drafts a whole block.
        k = recipe.draft.k_max or getattr(dcfg, "block_size", 2) - 1
    elif recipe.draft.enabled:
        k = recipe.draft.k_max      # host drafts: rows to verify, nothing else on the device
    seq = recipe.runtime.max_seq_len + 2 * k + 2
    rows, vocab, hidden = b * (k + 1), cfg.vocab_size, cfg.hidden_size
    s = recipe.sampling
    filters = s.temperature > 0 and (s.top_p < 1 or s.top_k > 0)
    relaxed = s.relaxed_acceptance is not None and k > 0
    parts = {
        "target weights": kept_quantized_bytes(recipe, r, shard, item)
        if kept_quantization(recipe, r.target_config) or gguf_blocks_kept(recipe, r.target_config, r.device)
        else shard.num_parameters() * item - fp8 * (item - 1) + fp8_scales * 4 - kept_int4,
        "target KV cache": shard.cache_bytes_per_token(r.dtype) * b * seq,
        # fp32 logits, processed log-probs, noise scores; top-k / top-p: probabilities, keys, masks;
        # relaxed acceptance: probabilities and a comparison
        "logits workspace": rows * vocab * 4 * (3 + (4 if filters else 0) + (2 if relaxed else 0)),
        # the reference path's scores over the longest bucket (the kernel's split-K partials are less)
        "attention workspace": rows * cfg.num_heads * seq * 4,
        "activations": rows * (2 * cfg.intermediate_size + 6 * hidden) * 4,
    }
    chunk, budget = (2048, 16384) if r.device.type == "cuda" else (512, 4096)
    parts["prefill workspace"] = budget * (2 * cfg.intermediate_size + 8 * hidden) * item + \
        min(budget, b * chunk) * cfg.num_heads * chunk * 4 // max(1, b)
    if r.device.type == "cuda" and recipe.runtime.compile is not False:
        parts["CUDA graph pool"] = parts["logits workspace"] + parts["activations"]
    if dcfg is not None:
        draft_item = torch.empty((), dtype=r.draft_dtype).element_size()
        parts["draft weights"] = dcfg.num_parameters(draft_tensor_names(recipe.draft.model_method, r.draft_folder, r.draft_config)) * draft_item
        if r.draft_dtype != r.dtype and recipe.draft.model_method in ("mtp", "dflash"):
            parts["draft weights"] += vocab * hidden * draft_item   # the shared head again, in its dtype
        parts["draft KV cache"] = dcfg.cache_bytes_per_token(r.draft_dtype) * b * seq
        if recipe.draft.stochastic:
            parts["draft probabilities"] = 2 * b * k * vocab * 4
    return parts




def kept_quantized_bytes(recipe: Recipe, r: Resolved, shape, item: int) -> int:
    """The target's weights as `quantize_on_load` keeps them (models/quantized.quantize_target): a
    GGUF's own blocks where it keeps them (4-bit: half a byte and a bf16 (scale, offset) pair per 32
    weights; 8-bit: int8 with a bf16 scale per row of about hidden_size weights), the rest of the
    layers and the head in the recipe's kind (or dense in the run's dtype), the embedding as 8-bit
    codes with two float32 per 32, and a dense head beside where a draft reads it. `item`: bytes of
    the run's dtype."""
    kind = kept_quantization(recipe, r.target_config)
    source = gguf_blocks_kept(recipe, r.target_config, r.device)
    published = published_formats(source) if source is not None else {}
    h, embedding = shape.hidden_size, shape.vocab_size * shape.hidden_size
    per_weight = {"int4": 0.5 + 4 / 32, "int8": 1 + 2 / h, None: item}
    by_format = lambda fmt: per_weight["int8" if fmt == "Q8_0" else "int4"]      # noqa: E731
    layers = shape.num_parameters() - embedding * (1 if shape.tie_word_embeddings else 2)
    kept = {n: f for n, f in published.items() if n.startswith("model.layers.")}
    total = sum(n * by_format(fmt) for fmt, n in kept.values()) + (layers - sum(n for _, n in kept.values())) * per_weight[kind]
    mla = getattr(shape, "mla", None)
    if kind is not None and mla is not None:      # MLA's kv_b_proj stays dense: attention reads it as a matrix
        kv_b = shape.num_layers * mla.kv_lora_rank * mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        total += kv_b * (item - per_weight[kind])
    if kind == "int8" and getattr(shape, "moe", None) is not None:     # routed experts stay dense in int8
        m = shape.moe
        experts = 3 * h * m.local_intermediate * m.local_experts * sum(map(shape.is_moe, range(shape.num_layers)))
        total += experts * (item - per_weight["int8"])
    head = published.get("model.embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight")
    head_kept = head is not None or kind is not None
    total += embedding * (by_format(head[0]) if head is not None else per_weight[kind])
    if not head_kept and shape.tie_word_embeddings:
        total -= embedding * item            # the head is the embedding itself, counted below
    quantized_embedding = kind is not None or "model.embed_tokens.weight" in published
    total += embedding * (1 + 8 / 32 if quantized_embedding else item)
    if head_kept and shares_target_head(recipe):
        total += embedding * item            # the dense head beside, for the draft
    return int(total)


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


# The share of what is free a run may plan to use (allocator slack, fragmentation, what the estimate
# leaves out)
MEMORY_MARGIN = 0.9
GIB = 1 << 30


def over_budget(parts: dict[str, int], device: torch.device, ranks_here: int = 1) -> tuple[int, int] | None:
    """(bytes needed, bytes free) where `parts` do not fit in MEMORY_MARGIN of what is free on `device`
    (on a CPU, this rank's share of the RAM among `ranks_here` ranks); None where they fit."""
    need, have = sum(parts.values()), available_bytes(device)
    if device.type == "cpu":
        have //= max(1, ranks_here)
    return (need, have) if need > MEMORY_MARGIN * have else None


def parts_text(parts: dict[str, int], smallest: int = 0) -> str:
    """"target weights 0.25 GiB, ..." for the parts of at least `smallest` bytes."""
    return ", ".join(f"{name} {size / GIB:.2f} GiB" for name, size in parts.items() if size >= smallest)


def where_free(device: torch.device) -> str:
    return "free device memory" if device.type == "cuda" else "available RAM"


def check_memory(recipe: Recipe, r: Resolved, ranks_here: int = 1) -> dict[str, int]:
    """`ranks_here`: processes of a torchrun job on this machine; on a CPU they share its RAM."""
    parts = estimate_bytes(recipe, r)
    over = over_budget(parts, r.device, ranks_here)
    if over is not None:
        (need, have), gib, detail, where = over, GIB, parts_text(parts), where_free(r.device)
        raise JobError(
            f"this run needs about {need / gib:.2f} GiB ({detail}) but only {have / gib:.2f} GiB of "
            f"{where} is there. Lower runtime.batch_size (now {recipe.runtime.batch_size}) or "
            f"runtime.max_seq_len (now {recipe.runtime.max_seq_len}), or use a smaller target.dtype.")
    return parts
