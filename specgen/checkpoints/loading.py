"""Targets and drafts from checkpoints: the only place that opens weight files for a model.

Contract:
- `target_config(config, where)` reads an HF config into the architecture's config object (the
  architecture comes from `specgen.registry`); a config we cannot read is a `CheckpointError`.
- `load_target(config, folder, dtype=, device=, dummy=)` returns a `Target` (models/protocol.py) in
  eval mode on `device`: weights read straight to the device in the run's dtype, or random weights
  built there directly (`dummy`).
- `load_draft(method, config, folder, target, ...)` reads the draft's tensors (those under the
  method's weight prefix, `read_draft_tensors`; none when dummy) and hands them to the method's
  builder: drafts receive tensors and never open files. Its `dtype` may differ from the target's
  (drafts/precision.py).
- `dry=True` (both loaders): the same path on the file headers (checkpoints/headers.py), returning the
  module on the meta device: every check a real load makes (files, shards, key layout, shapes,
  quantisation scales, the draft's config against its target) runs, and no tensor is read. `run`
  does this before loading anything; `inspect-checkpoint` reports what it finds.
- `draft_tensor_names` / `has_draft_layers(method, folder, config)`: a method's tensors in a checkpoint; whether a checkpoint carries a method's layers (MTP
  layers inside a target checkpoint), from the file headers alone; `unread_tensor_groups` names
  what a target leaves unread (Kimi K2.5's vision encoder in a text-only run).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch

from specgen.checkpoints.headers import ShapeMismatch, checkpoint_headers
from specgen.checkpoints.quantized import ROUTED_EXPERT, quantization_of
from specgen.checkpoints.store import CheckpointError, weight_files
from specgen.checkpoints.weights import read_tensor_headers, read_tensors, tensor_names
from specgen.drafts.precision import target_for_draft
from specgen.models.decoder import beyond_last_layer
from specgen.kernels import block_fp8
from specgen.models.fp8_layers import with_fp8_layers
from specgen.models.materialise import build
from specgen.models.moe import int4_experts_for_cpu, keep_int4_experts
from specgen.models.tensor_parallel import TensorParallel, rank_shape
from specgen.registry import DRAFT_METHODS, UnsupportedError, architecture_name, target_architecture


def target_builder(config: dict, where: str = "config.json"):
    try:
        return target_architecture(config, where).builder()
    except UnsupportedError as err:
        raise CheckpointError(str(err)) from err


def target_config(config: dict, where: str = "config.json"):
    try:
        return target_builder(config, where).config_cls.from_hf(config)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{where}: cannot read the model config: {err!r}") from err


def load_target(config: dict, folder: Path | None, *, dtype: torch.dtype, device, dummy: bool,
                seed: int = 0, dry: bool = False, tp: TensorParallel = TensorParallel(),
                keep_fp8: bool = False, keep_int4: bool = False):
    """`tp`: build this rank's slice of a tensor-parallel target (models/tensor_parallel.py).
    `keep_fp8`: block-FP8 weights stay FP8, multiplied block-scaled (models/fp8_layers.py).
    `keep_int4`: packed INT4 routed experts stay packed (kernels/int4_experts.py; on a CPU repacked
    once for torch's int4 kernel)."""
    where = str(folder / "config.json") if folder else "config.json"
    builder = target_builder(config, where)
    cfg = target_config(config, where)
    if tp.active:
        check_tensor_parallel(config, tp.size, where)
    quantization = quantization_of(config, where)
    keep_fp8 = keep_fp8 and quantization is not None and quantization.fp8_block is not None
    keep_int4 = keep_int4 and quantization is not None and quantization.int4_group is not None
    if keep_fp8 or keep_int4:
        quantization = replace(quantization, keep_fp8=keep_fp8, keep_int4=keep_int4)
    state = None
    if not dummy:
        tensors = _read(folder, dry, device=device, dtype=dtype, reads=builder.reads, quantization=quantization)
        state = _converted(lambda: builder.convert_state_dict(tensors, cfg), folder)
        if tp.active:
            state = _converted(lambda: builder.shard_state(state, cfg, tp), folder)
    make = (lambda: builder.model_cls(cfg, tp)) if tp.active else (lambda: builder.model_cls(cfg))
    if keep_fp8:
        make_plain = make
        make = lambda: _converted(lambda: with_fp8_layers(make_plain(), state), folder)  # noqa: E731
    if keep_int4:
        make_dense = make
        make = lambda: keep_int4_experts(make_dense(), state, quantization.int4_group)  # noqa: E731
    model = build(make, state, dtype=dtype, device=device, seed=seed, where=str(folder))
    if keep_int4 and torch.device(device).type == "cpu":
        int4_experts_for_cpu(model)
    if keep_fp8:
        # the scaled_mm probe copies to the host and syncs: run it now, never first inside a CUDA
        # graph capture (the first compiled step's), which it would break (GPU_NOTES 6)
        block_fp8.scaled_mm_works(torch.device(device))
    return model.eval().requires_grad_(False)


def kept_fp8_elements(config: dict, folder: Path | None) -> tuple[int, int]:
    """(elements of the FP8 weights a target keeps as FP8, elements of their float32 scales), from
    the checkpoint's headers: the target's own tensors only (not an MTP layer past its last layer,
    not a vision encoder), less those the model dequantises anyway (`FP8_DEQUANTIZED`)."""
    quantization = quantization_of(config, "config.json")
    if folder is None or quantization is None or quantization.fp8_block is None \
            or not any(folder.glob("*.safetensors")):
        return 0, 0
    builder = target_builder(config)
    layers = target_config(config).num_layers
    dequantized = getattr(builder.model_cls, "FP8_DEQUANTIZED", ())
    headers = checkpoint_headers(folder)
    weights = scales = 0
    for name, header in headers.items():
        if not name.endswith(".weight_scale_inv") or not builder.reads(name) or beyond_last_layer(name, layers):
            continue
        base = name.removesuffix("_scale_inv")
        if base.removesuffix(".weight").endswith(dequantized) or base not in headers:
            continue
        weights += math.prod(headers[base].shape)
        scales += math.prod(header.shape)
    return weights, scales


def kept_int4_parts(config: dict, folder: Path | None) -> tuple[int, int, int]:
    """(parameters of the packed INT4 routed experts a target keeps packed, the bytes of their words,
    the bytes of their scales as published), from the checkpoint's headers; zeros for any other."""
    quantization = quantization_of(config, "config.json")
    if folder is None or quantization is None or quantization.int4_group is None \
            or not any(folder.glob("*.safetensors")):
        return 0, 0, 0
    builder = target_builder(config)
    layers = target_config(config).num_layers
    headers = checkpoint_headers(folder)
    parameters = words = scales = 0
    for name, header in headers.items():
        if not name.endswith(".weight_packed") or not builder.reads(name) or beyond_last_layer(name, layers) \
                or not ROUTED_EXPERT.search(name):
            continue
        scale = headers.get(name.removesuffix("_packed") + "_scale")
        parameters += math.prod(header.shape) * 8
        words += math.prod(header.shape) * 4
        scales += math.prod(scale.shape) * scale.dtype.itemsize if scale is not None else 0
    return parameters, words, scales


def check_tensor_parallel(config: dict, size: int, where: str = "config.json") -> None:
    """A CheckpointError unless the target's architecture splits over `size` ranks."""
    builder = target_builder(config, where)
    if builder.shard_state is None:
        raise CheckpointError(f"{where}: {architecture_name(config)} has no tensor-parallel layout in specgen yet "
                              f"(runtime.tensor_parallel_size {size}); Llama, DeepSeek-V3 and Kimi K2.5 targets have one")
    try:
        rank_shape(builder.config_cls.from_hf(config), TensorParallel(0, size))
    except ValueError as err:
        raise CheckpointError(f"{where}: {err}") from None


def load_draft(method: str, config: dict, folder: Path | None, target, *,
               num_speculative_tokens: int | None, dtype: torch.dtype, device, dummy: bool,
               seed: int = 0, dry: bool = False):
    builder = DRAFT_METHODS[method].builder()
    state = None
    if not dummy:
        state = read_draft_tensors(method, config, Path(folder), dtype=dtype, device=device, dry=dry)
    target = target_for_draft(target, dtype)
    draft = _converted(lambda: builder.build(config, state, target, num_speculative_tokens=num_speculative_tokens,
                                             dtype=dtype, device=device, seed=seed,
                                             where=str(folder) if folder else "draft"), folder)
    return draft.eval().requires_grad_(False)


def read_draft_tensors(method: str, config: dict, folder: Path, *, dtype: torch.dtype, device,
                       dry: bool = False) -> dict[str, torch.Tensor]:
    """A draft's tensors in its checkpoint's own key layout (the method's weight prefix stripped),
    for its builder: `load_draft`, and `train-draft` starting from a trained draft."""
    prefix = DRAFT_METHODS[method].builder().weight_prefix(config)
    state = _read(folder, dry, prefix=prefix, strip_prefix=True, device=device, dtype=dtype,
                  quantization=quantization_of(config, str(folder)))
    if not state:
        raise CheckpointError(f"{folder}: no {method.upper()} weights (no tensors under {prefix or 'the root'}*)")
    return state


def _read(folder: Path, dry: bool, *, device, **how) -> dict:
    if dry:
        return read_tensor_headers(folder, **how)
    return read_tensors(weight_files(folder), device=device, **how)


def _converted(convert, folder: Path | None):
    """A key conversion that looks up a tensor the checkpoint lacks, or fuses / stacks tensors whose
    shapes disagree, reports it naming the folder (a dry load names the tensors too)."""
    try:
        return convert()
    except KeyError as err:
        raise CheckpointError(f"{folder}: missing tensor {err.args[0]}") from None
    except (ShapeMismatch, RuntimeError) as err:
        raise CheckpointError(f"{folder}: {err}") from None


def unread_tensor_groups(config: dict, folder: Path | None) -> list[str]:
    """Top-level names of the checkpoint tensors the target's architecture does not read (for the log:
    Kimi K2.5's `vision_tower`, `mm_projector`), from the file headers."""
    if folder is None:
        return []
    reads = target_builder(config).reads
    return sorted({n.split(".", 1)[0] for n in tensor_names(folder) if not reads(n)})


def draft_tensor_names(method: str, folder: Path | None, config: dict) -> frozenset[str]:
    """The names of a method's tensors in a checkpoint, its weight prefix stripped (headers only)."""
    if folder is None:
        return frozenset()
    prefix = DRAFT_METHODS[method].builder().weight_prefix(config)
    return frozenset(n[len(prefix):] for n in tensor_names(Path(folder)) if n.startswith(prefix))


def has_draft_layers(method: str, folder: Path | None, config: dict) -> bool:
    return bool(draft_tensor_names(method, folder, config))
