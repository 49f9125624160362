"""A recipe resolved into what the run will use, checked before any weight loads.

Contract: `resolve(recipe)` finds the target's and the draft's checkpoints (aliases, a draft layer
inside the target's checkpoint), reads their configs (`target.hf_overrides` applied), chooses the
device and the dtypes (`auto_dtype`, `draft_dtype`: measured choices, their reasons in the
docstrings), reads `draft.suffix_history`, and loads both checkpoints dry (headers only, modules on
the meta device: `check_checkpoints`), so a truncated file, a missing shard, a wrong shape or a
draft for another target stops the run in seconds, naming the file. Returns a `Resolved`; raises
`InputError` (job/errors.py) for everything it finds wrong. `check_output` checks the output path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specgen.checkpoints.headers import without_gc
from specgen.checkpoints.loading import has_draft_layers, load_draft, load_target, target_config
from specgen.checkpoints.gguf_blocks import gguf_source
from specgen.checkpoints.quantized import quantization_of
from specgen.checkpoints.store import CheckpointError, read_config, resolve_checkpoint
from specgen.data import ResultsFileError, read_answer_ids
from specgen.job.errors import InputError
from specgen.kernels.block_fp8 import fp8_gemm_supported
from specgen.kernels.int4_experts import int4_kernel_supported
from specgen.machine import cpu_has_amx, cpu_has_avx512, cpu_has_bf16
from specgen.models.tensor_parallel import TensorParallel
from specgen.recipe import Recipe
from specgen.registry import DRAFT_METHODS, UnsupportedError, architecture_name, check_pairing


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class Resolved:
    device: torch.device
    dtype: torch.dtype
    target_folder: Path | None
    target_config: dict
    draft_folder: Path | None
    draft_config: dict | None
    draft_dtype: torch.dtype                 # the draft's (the target's unless draft.dtype says)
    # `draft.suffix_history`'s answers, read and checked against the target's vocabulary (None: not asked)
    suffix_history: list[list[int]] | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InputError("recipe.runtime.device: cuda was asked for but no CUDA device is available")
    return torch.device(name)


def resolve(recipe: Recipe) -> Resolved:
    device = resolve_device(recipe.runtime.device)
    dtype_name = recipe.target.dtype
    if dtype_name == "auto":
        dtype_name = auto_dtype(device)
    dummy = recipe.target.load_format == "dummy"
    try:
        folder = resolve_checkpoint(recipe.target.model, needs_weights=not dummy)
        config = with_overrides(read_config(folder), recipe.target.hf_overrides)
        cfg = target_config(config, str(folder / "config.json"))  # fails early on a config we can't read
        draft_folder = draft_cfg = None
        if recipe.draft.enabled:
            check_pairing(architecture_name(config), recipe.draft.method)
            if draft_inside_a_dummy_target(recipe):
                draft_cfg = config    # its layer comes from the target's config, random like the target
            elif recipe.draft.has_model and recipe.draft.load_format != "dummy":
                draft_folder, draft_cfg = draft_checkpoint(recipe, folder, config)
    except (CheckpointError, UnsupportedError, ValueError) as err:
        raise InputError(str(err)) from err
    check_quantization(recipe, device, config)
    dtype = DTYPES[dtype_name]
    resolved = Resolved(device, dtype, folder, config, draft_folder, draft_cfg,
                        draft_dtype(recipe.draft.dtype, dtype, device))
    resolved.suffix_history = read_suffix_history(recipe, cfg.vocab_size)
    check_checkpoints(recipe, resolved)
    return resolved


# The targets whose products `target.quantization` keeps quantized (models/quantized.quantize_target:
# every nn.Linear of the layers, MoE experts in int4, and the head)
QUANTIZABLE_TARGETS = ("LlamaForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
# The targets whose GGUF blocks are read as they are (checkpoints/gguf_blocks.py names Llama's tensors)
GGUF_REPACKED_TARGETS = ("LlamaForCausalLM",)


def published_int4(config: dict) -> bool:
    """Whether the checkpoint publishes packed INT4 weights (Kimi K2.5's routed experts)."""
    try:
        quantization = quantization_of(config, "config.json")
    except CheckpointError:
        return False
    return quantization is not None and quantization.int4_group is not None


def keeps_int4(recipe: Recipe, config: dict, device: torch.device) -> bool:
    """Whether a checkpoint's packed INT4 routed experts stay packed (kernels/int4_experts.py): auto
    keeps them where a kernel multiplies them (a CPU: torch's int4 kernel; a CUDA GPU with Triton),
    int4 asks for them (`check_quantization` refuses a GPU without the kernel), none dequantises them
    on load; random weights (load_format: dummy) have none to keep."""
    setting = recipe.target.quantization
    if not published_int4(config) or setting in ("none", "int8") or recipe.target.load_format == "dummy":
        return False
    return setting == "int4" or device.type == "cpu" or int4_kernel_supported(device)


def gguf_blocks_kept(recipe: Recipe, config: dict, device: torch.device) -> Path | None:
    """The GGUF whose own Q4_0 / Q4_1 / Q8_0 blocks the target keeps (checkpoints/gguf_blocks.py), or
    None: a Llama-family target converted from a GGUF, target.quantization auto or int4, on a CPU in
    one process (int8 and none quantize or keep its dequantised weights instead)."""
    source = gguf_source(config)
    if source is None or recipe.target.quantization not in ("auto", "int4") or device.type != "cpu":
        return None
    if architecture_name(config) not in GGUF_REPACKED_TARGETS or recipe.runtime.tensor_parallel_size > 1:
        return None
    return source


def shares_target_head(recipe: Recipe) -> bool:
    """Whether the draft multiplies by the target's own head (MTP, DFlash): a quantized head then keeps
    its dense weight beside (models/quantized.quantize_target's keep_dense_head)."""
    return recipe.draft.model_method in ("mtp", "dflash")


def kept_quantization(recipe: Recipe, config: dict) -> str | None:
    """The weight-only quantization the run applies on load ("int8" / "int4"), or None: auto (a
    checkpoint's own quantization, as `keeps_int4` and `keeps_fp8` say, else none), none, and int4 on
    a checkpoint that publishes INT4 already (its experts are kept as published; the rest stays dense)."""
    kind = recipe.target.quantization
    if kind not in ("int8", "int4") or (kind == "int4" and published_int4(config)):
        return None
    return kind


def check_quantization(recipe: Recipe, device: torch.device, config: dict) -> None:
    """What `target.quantization` can run on (InputError naming the field otherwise): quantized on
    load on CPU, in one process; a published INT4 checkpoint's experts anywhere a kernel is."""
    if recipe.target.quantization == "int4" and published_int4(config) and device.type == "cuda" \
            and not int4_kernel_supported(device):
        # the reference would gather every pair's expert as float32: terabytes for Kimi K2.5's prefill
        raise InputError("recipe.target.quantization: int4: this GPU has no kernel for the checkpoint's INT4 experts "
                         "(Triton on compute capability 8.0 and up); set target.quantization: none to dequantise them")
    kind = kept_quantization(recipe, config)
    if kind is None:
        return
    where = f"recipe.target.quantization: {kind}"
    if device.type != "cpu":
        raise InputError(f"{where}: quantizing on load runs on CPU for now (a GPU keeps only a checkpoint's "
                         "published INT4 experts); set runtime.device: cpu or target.quantization: none")
    architecture = architecture_name(config)
    if architecture not in QUANTIZABLE_TARGETS:
        raise InputError(f"{where}: not yet for {architecture} (supported: {', '.join(QUANTIZABLE_TARGETS)})")
    if recipe.runtime.tensor_parallel_size > 1:
        raise InputError(f"{where}: not yet with runtime.tensor_parallel_size > 1")


def read_suffix_history(recipe: Recipe, vocab_size: int) -> list[list[int]] | None:
    """`draft.suffix_history`'s answers where a host draft uses them (None elsewhere); a line that is
    not a result, or holds an id outside the target's vocabulary, is an `InputError` naming it."""
    if recipe.draft.host_method is None or recipe.draft.suffix_history is None:
        return None
    try:
        return read_answer_ids(Path(recipe.draft.suffix_history), vocab_size)
    except ResultsFileError as err:
        raise InputError(f"draft.suffix_history: {err}") from None


def draft_dtype(name: str, target_dtype: torch.dtype, device: torch.device, compiled: bool = True) -> torch.dtype:
    """`draft.dtype`: auto = bfloat16 where bf16 pays (`auto_dtype`), else the target's. The draft only
    proposes, so a float32 target keeps its exact output beside a bf16 draft (drafts/precision.py),
    and a draft pass reads every draft weight for a few rows: its time is the bytes it reads. Where
    bf16 GEMMs have no kernel of specgen's they convert every weight and run slower, so the draft
    keeps the target's dtype there. Figures: docs/targets-and-checkpoints.md, "Which dtype"."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if auto_dtype(device, compiled) == "bfloat16" else target_dtype


def auto_dtype(device: torch.device, compiled: bool = True) -> str:
    """`target.dtype: auto`: bfloat16 on CUDA, on CPUs that multiply it natively (AMX, AVX512-BF16:
    vLLM's CPU backend chooses the same) and, for compiled steps, on other AVX-512 CPUs, where
    specgen's converting kernel (kernels/cpu_bf16_dot.py) makes bf16 steps faster than float32 ones
    at 1 and 8 slots; eager steps there (`compiled` False) would run the prefill's bf16 through
    oneDNN's emulation, slower than float32 (docs/targets-and-checkpoints.md, "Which dtype"). float32 elsewhere (AVX2 alone:
    unmeasured, and Inductor's bf16 kernel converts every weight twice), and for compiled steps on
    AMX CPUs: there Inductor multiplies bf16 with its AMX micro-kernel, whose rows no test of ours
    has seen on such a CPU, and auto's choice must give plain decoding's very tokens (docs/exactness.md); their eager steps multiply row-invariantly (kernels/cpu_linear.py) and keep
    bf16. Lossless always means against plain decoding in the same dtype."""
    if device.type == "cuda":
        return "bfloat16"
    if device.type == "cpu" and compiled and cpu_has_amx():
        return "float32"
    if device.type == "cpu" and (cpu_has_bf16() or (compiled and cpu_has_avx512())):
        return "bfloat16"
    return "float32"


def check_checkpoints(recipe: Recipe, r: Resolved) -> None:
    """Load the target and the draft dry (headers only, modules on the meta device): every check a
    real load makes, in seconds, before anything is read. Problems are an `InputError`."""
    dummy = recipe.target.load_format == "dummy"
    try:
        with without_gc():
            target = load_target(r.target_config, r.target_folder, dtype=r.dtype, device="meta",
                                 dummy=dummy, dry=not dummy, tp=planned_tensor_parallel(recipe),
                                 keep_fp8=keeps_fp8(recipe, r.device),
                                 keep_int4=keeps_int4(recipe, r.target_config, r.device))
            if recipe.draft.enabled and r.draft_config is not None and recipe.draft.load_format != "dummy":
                load_draft(recipe.draft.model_method, r.draft_config, r.draft_folder, target,
                           num_speculative_tokens=recipe.draft.k_max, dtype=r.draft_dtype,
                           device="meta", dummy=r.draft_folder is None, dry=r.draft_folder is not None)
    except (CheckpointError, ValueError) as err:
        raise InputError(str(err)) from err


def keeps_fp8(recipe: Recipe, device: torch.device) -> bool:
    """`target.fp8_weights`: whether a block-FP8 checkpoint's weights stay FP8 (auto: where FP8
    tensor cores multiply them, kernels/block_fp8.py); a checkpoint without FP8 weights ignores it."""
    setting = recipe.target.fp8_weights
    return setting == "keep" or (setting == "auto" and fp8_gemm_supported(device))


def planned_tensor_parallel(recipe: Recipe) -> TensorParallel:
    """The split a recipe asks for, without a group: for dry loads and memory estimates (rank 0's
    slice: every rank's is the same size)."""
    return TensorParallel(0, recipe.runtime.tensor_parallel_size, None, recipe.runtime.expert_parallel)


def check_output(path: Path) -> None:
    """The output's folder exists (created if need be) and the output can be written, or InputError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"{path}: cannot create its folder {path.parent}: {err.strerror or err}") from None
    if path.is_dir():
        raise InputError(f"{path}: is a folder; the output is a .jsonl file")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise InputError(f"{path}: not writable")


def with_overrides(config: dict, overrides: dict) -> dict:
    """config.json with `target.hf_overrides` applied (nested mappings merge, e.g. Kimi's text_config)."""
    merged = dict(config)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = with_overrides(merged[key], value)
        else:
            merged[key] = value
    return merged


def draft_inside_a_dummy_target(recipe: Recipe) -> bool:
    """MTP without draft.model on a dummy target: the layer the config describes, with random weights."""
    return (recipe.target.load_format == "dummy" and recipe.draft.model is None and recipe.draft.has_model
            and recipe.draft.load_format != "dummy" and DRAFT_METHODS[recipe.draft.model_method].lives_in_target)


def draft_checkpoint(recipe: Recipe, target_folder: Path, target_config: dict) -> tuple[Path, dict]:
    if recipe.draft.model is not None:
        folder = resolve_checkpoint(recipe.draft.model)
        return folder, read_config(folder)
    # Only methods whose layer can live in the target's checkpoint get here (registry: lives_in_target).
    method = recipe.draft.model_method
    if not has_draft_layers(method, target_folder, target_config):
        prefix = DRAFT_METHODS[method].builder().weight_prefix(target_config)
        raise CheckpointError(f"{target_folder}: draft.method {method} without draft.model needs "
                              f"{method.upper()} layers in the target checkpoint ({prefix}*), and there "
                              "are none")
    return target_folder, target_config
