"""`specgen run` as a library call: a validated recipe in, results JSONL + stats JSON out.

Contract: `run_job(recipe, ...)` resolves the device and checkpoints, checks that the run fits in
memory BEFORE any weights load, skips ids already in the output (resume), decides the CPU threads and
whether compiling pays (saying why in the run's header), streams one result line per prompt as it
finishes (errors are records, never crashes), and writes `<output>.stats.json` at the end (also after
Ctrl-C, for what finished). Raises `JobError` for problems with the run as a whole, and its
`InputError` for bad input (a checkpoint, the output path, the prompt source, the device asked for).

Before anything loads, the output path is checked (its folder created, writable) and the target's
and the draft's checkpoints are loaded dry (checkpoints/loading.py `dry=True`: headers only), so a
truncated file, a missing shard, a wrong shape or a draft for another target stops the run in
seconds, naming the file. The statistics cover every record in the output, a resumed run's
included. A draft whose acceptance length stays at about 1.0 over its first `MISMATCH_DRAFTS`
drafts is reported (it is probably not this target's draft).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specgen.checkpoints.headers import without_gc
from specgen.checkpoints.loading import (
    draft_tensor_names,
    kept_fp8_elements,
    has_draft_layers,
    load_draft,
    load_target,
    target_config,
    unread_tensor_groups,
)
from specgen.checkpoints.store import CheckpointError, cache_root, read_config, resolve_checkpoint
from specgen.checkpoints.tokenizer import load_tokenizer
from specgen.data import (PromptRecord, PromptSourceError, ResultsFileError, ResultWriter, read_answer_ids,
                          read_prompts, stats_path, tokenize_with_generation_start, write_json_atomic)
from specgen.drafts.forced import JUMP_FORWARD_K
from specgen.drafts.suffix import SuffixProposer
from specgen.kernels.block_fp8 import fp8_gemm_supported
from specgen.machine import choose_threads, cpu_has_amx, cpu_has_avx512, cpu_has_bf16
from specgen.models.tensor_parallel import TensorParallel, rank_shape
from specgen.parallel.decisions import SharedDecisions
from specgen.parallel.progress import JobProgress
from specgen.parallel.shards import finished_ids, merge_parts, part_path, remove_parts, shard_of
from specgen.parallel.world import World
from specgen.pipelines.compiled import freezes, use_compile_cache
from specgen.pipelines.host_policy import HostDraftPolicy
from specgen.pipelines.hybrid_policy import HybridPolicy
from specgen.pipelines.logprobs import Logprobs
from specgen.pipelines.policy import FIRST_PROBE_INTERVAL, AdaptivePolicy, FixedPolicy, per_position_prior
from specgen.pipelines.reasoning import THINK_END, THINK_START, ReasoningMarkers
from specgen.pipelines.relaxed import RelaxedAcceptance
from specgen.pipelines.runner import Completion, Progress, Request, Runner, RunTotals
from specgen.pipelines.stats import SpecCounters
from specgen.pipelines.stops import StopRules, eos_ids_from
from specgen.pipelines.unified import UnifiedStep
from specgen.recipe import Recipe
from specgen.registry import DRAFT_METHODS, UnsupportedError, architecture_name, check_pairing
from specgen.sampling import SamplingTensors
from specgen.structured.formats import ResponseFormat
from specgen.structured.grammar import GrammarEngine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class JobError(Exception):
    """The run as a whole cannot start (memory, checkpoint, prompt source); nothing was lost."""


class InputError(JobError):
    """Input the run cannot use (checkpoint, output path, prompt source, device): exit code 2."""

    exit_code = 2


# A draft that is not random-init, whose mean acceptance length stays below MISMATCH_LENGTH over its
# first MISMATCH_DRAFTS drafts, is probably mismatched (a draft loaded in the wrong mode, or made for
# another target, still matches a common token now and then, so "exactly 1.0" would miss it).
MISMATCH_DRAFTS = 300
MISMATCH_LENGTH = 1.05


@dataclass(slots=True)
class JobSummary:
    output: Path
    stats_file: Path
    stats: dict
    skipped: int
    notes: list[str]


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
            if _draft_inside_a_dummy_target(recipe):
                draft_cfg = config    # its layer comes from the target's config, random like the target
            elif recipe.draft.has_model and recipe.draft.load_format != "dummy":
                draft_folder, draft_cfg = _draft_checkpoint(recipe, folder, config)
    except (CheckpointError, UnsupportedError, ValueError) as err:
        raise InputError(str(err)) from err
    dtype = DTYPES[dtype_name]
    resolved = Resolved(device, dtype, folder, config, draft_folder, draft_cfg,
                        draft_dtype(recipe.draft.dtype, dtype, device))
    resolved.suffix_history = read_suffix_history(recipe, cfg.vocab_size)
    check_checkpoints(recipe, resolved)
    return resolved


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
    keeps the target's dtype there. Figures: README, "The draft's dtype"."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if auto_dtype(device, compiled) == "bfloat16" else target_dtype


def auto_dtype(device: torch.device, compiled: bool = True) -> str:
    """`target.dtype: auto`: bfloat16 on CUDA, on CPUs that multiply it natively (AMX, AVX512-BF16:
    vLLM's CPU backend chooses the same) and, for compiled steps, on other AVX-512 CPUs, where
    specgen's converting kernel (kernels/cpu_bf16_dot.py) makes bf16 steps faster than float32 ones
    at 1 and 8 slots; eager steps there (`compiled` False) would run the prefill's bf16 through
    oneDNN's emulation, slower than float32 (README, "Which dtype"). float32 elsewhere (AVX2 alone:
    unmeasured, and Inductor's bf16 kernel converts every weight twice), and for compiled steps on
    AMX CPUs: there Inductor multiplies bf16 with its AMX micro-kernel, whose rows no test of ours
    has seen on such a CPU, and auto's choice must give plain decoding's very tokens (README, "What
    is exact where"); their eager steps multiply row-invariantly (kernels/cpu_linear.py) and keep
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
                                 keep_fp8=keeps_fp8(recipe, r.device))
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


def _draft_inside_a_dummy_target(recipe: Recipe) -> bool:
    """MTP without draft.model on a dummy target: the layer the config describes, with random weights."""
    return (recipe.target.load_format == "dummy" and recipe.draft.model is None and recipe.draft.has_model
            and recipe.draft.load_format != "dummy" and DRAFT_METHODS[recipe.draft.model_method].lives_in_target)


def _draft_checkpoint(recipe: Recipe, target_folder: Path, target_config: dict) -> tuple[Path, dict]:
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


# ------------------------------------------------------------------------------------------- memory


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
        "target weights": shard.num_parameters() * item - fp8 * (item - 1) + fp8_scales * 4,
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


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def check_memory(recipe: Recipe, r: Resolved, ranks_here: int = 1) -> dict[str, int]:
    """`ranks_here`: processes of a torchrun job on this machine; on a CPU they share its RAM."""
    parts = estimate_bytes(recipe, r)
    need, have = sum(parts.values()), available_bytes(r.device)
    if r.device.type == "cpu":
        have //= max(1, ranks_here)
    if need > 0.9 * have:
        gib = 1 << 30
        detail = ", ".join(f"{name} {size / gib:.2f} GiB" for name, size in parts.items())
        where = "free device memory" if r.device.type == "cuda" else "available RAM"
        raise JobError(
            f"this run needs about {need / gib:.2f} GiB ({detail}) but only {have / gib:.2f} GiB of "
            f"{where} is there. Lower runtime.batch_size (now {recipe.runtime.batch_size}) or "
            f"runtime.max_seq_len (now {recipe.runtime.max_seq_len}), or use a smaller target.dtype.")
    return parts


# ---------------------------------------------------------------------------------------------- run


def request_key(request_id: str) -> int:
    """A request's noise stream comes from its id, so a resumed run reproduces it."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")


# CPU, `runtime.compile: auto`: compile only a job long enough to win the compile time back.
# Measured on 2 cores (SmolLM2, batch 1): with frozen weights (every step up to 64 rows, see
# pipelines/compiled.py) compiling takes 50-70 s each run (frozen graphs miss Inductor's graph
# cache; its kernels and autotuning results are cached) and saves ~40 ms of a ~65 ms eager step.
# Without (larger steps) ~15 s, 10 s once Inductor's disk cache holds it, and saves ~18 ms of ~130.
CPU_COMPILE_MIN_STEPS = {"frozen": 1800, "not frozen": 800}


def decide_compile(recipe: Recipe, device: torch.device, expected_steps: int | None,
                   slots: int) -> tuple[bool, str]:
    """`runtime.compile` resolved: (compile?, why) for the run's header. `slots`: the batch size."""
    setting = recipe.runtime.compile
    if setting is not None:
        return setting, "runtime.compile"
    if device.type == "cuda":
        return True, "auto: CUDA graphs"
    if expected_steps is None:
        return False, "auto: job size unknown"
    needed = CPU_COMPILE_MIN_STEPS["frozen" if freezes(device, slots) else "not frozen"]
    if expected_steps >= needed:
        return True, f"auto: about {expected_steps} steps, long enough to pay back compiling"
    return False, (f"auto: about {expected_steps} steps, too few to pay back compiling "
                   f"(needs >= {needed}; runtime.compile: true forces it)")


def build_runner(recipe: Recipe, r: Resolved, seed: int, *, expected_steps: int | None = None,
                 target=None, tokenizer=None, expected_tokens: int | None = None,
                 structured: bool | None = None, threads: tuple[int, str] | None = None,
                 tp: TensorParallel = TensorParallel()):
    """Load the models and bind them into a Runner; returns (runner, tokenizer, notes).

    `runner.header` is one line saying what runs where: device, dtype, threads, compile, batch, draft.
    `expected_steps` (decode steps the job will take, roughly) lets `runtime.compile: auto` decide;
    `expected_tokens` (output tokens it may produce) tells an adaptive K what compiling can repay.
    `target` / `tokenizer`: already loaded ones to share (several runners over one target: bench).
    `structured`: some request has a response_format (default: the recipe has one); the step then
    takes token masks and the runner a grammar engine (specgen/structured). `threads`: (count, why)
    decided by the caller (a data-parallel rank's share of the CPUs); else `runtime.threads` or what
    is free (machine.py). `tp`: this rank's slice of a tensor-parallel target."""
    notes: list[str] = []
    threads, why_threads = threads if threads is not None and recipe.runtime.threads is None \
        else choose_threads(recipe.runtime.threads)
    torch.set_num_threads(threads)
    if tokenizer is None:     # first: a recipe its tokenizer cannot serve stops before weights load
        tokenizer = load_tokenizer(r.target_folder, target_config(r.target_config).vocab_size)
    markers = reasoning_markers(recipe, tokenizer)
    b = recipe.runtime.batch_size
    compile, why_compile = decide_compile(recipe, r.device, expected_steps, b)
    if target is None and not compile:
        # `resolve` chose the auto dtypes for compiled steps; eager ones may want others (auto_dtype)
        dtype = DTYPES[auto_dtype(r.device, compiled=False)] if recipe.target.dtype == "auto" else r.dtype
        r = replace(r, dtype=dtype, draft_dtype=draft_dtype(recipe.draft.dtype, dtype, r.device, compiled=False))
    dummy_target = recipe.target.load_format == "dummy"
    if target is None:
        target = load_target(r.target_config, r.target_folder, dtype=r.dtype, device=r.device,
                             dummy=dummy_target, tp=tp, keep_fp8=keeps_fp8(recipe, r.device))
    if dummy_target:
        notes.append("target.load_format is dummy: random weights, the output text is meaningless "
                     "(for measuring speed only)")
    else:
        unread = unread_tensor_groups(r.target_config, r.target_folder)
        if unread:
            notes.append(f"text-only run: the checkpoint's {', '.join(unread)} weights are not loaded")
    draft = None
    proposer = None
    if recipe.draft.host_method is not None:
        history = ()
        if recipe.draft.suffix_history is not None:
            history = r.suffix_history if r.suffix_history is not None else \
                read_suffix_history(recipe, target_config(r.target_config).vocab_size)
            notes.append(f"draft.suffix_history: the job-wide suffix index starts from {len(history)} answers "
                         f"of {recipe.draft.suffix_history}")
        proposer = SuffixProposer(b, history=history)
        if recipe.draft.model and not recipe.draft.has_model:
            notes.append(f"draft.method is {recipe.draft.method}: draft.model ({recipe.draft.model}) is not used")
    if recipe.draft.has_model:
        builder = DRAFT_METHODS[recipe.draft.model_method].builder()
        dummy = recipe.draft.load_format == "dummy" or _draft_inside_a_dummy_target(recipe)
        draft = load_draft(recipe.draft.model_method, r.draft_config or builder.dummy_config(target.shape),
                           r.draft_folder, target, num_speculative_tokens=recipe.draft.k_max,
                           dtype=r.draft_dtype, device=r.device, dummy=dummy)
        if _draft_inside_a_dummy_target(recipe):
            notes.append(f"the target is dummy, so its {recipe.draft.model_method} layer is random too")
        elif dummy:
            notes.append(f"draft.load_format is dummy: a RANDOMLY INITIALISED {recipe.draft.model_method} "
                         "draft (deterministic, demo only); output equals the target's alone but "
                         "acceptance is near zero")
    generation_config = {}
    if r.target_folder and (r.target_folder / "generation_config.json").is_file():
        generation_config = json.loads((r.target_folder / "generation_config.json").read_text())
    eos = eos_ids_from(tokenizer, generation_config, r.target_config)
    if structured is None:
        fmt = recipe.sampling.response_format
        structured = fmt is not None and fmt.constrains
    grammar = GrammarEngine(tokenizer, target.vocab_size, eos) if structured else None
    relaxed = None
    spec = recipe.sampling.relaxed_acceptance
    if spec is not None and markers is not None:
        if draft is None:
            notes.append("sampling.relaxed_acceptance has no effect without a draft model")
        else:
            relaxed = RelaxedAcceptance(spec.top_k, spec.delta, markers, tuple(sorted(eos)))
            notes.append(f"sampling.relaxed_acceptance is on (top_k {spec.top_k}, delta {spec.delta}): LOSSY "
                         "inside reasoning spans, whose tokens are no longer distributed as the target's; "
                         "the rest is verified strictly")
    use_kernel, num_sms = attention_kernel_for(r.device)
    # plain decoding under a format verifies the tokens the grammar forces as host drafts
    # (jump-forward, drafts/forced.py; the runner proposes them). Eager steps only: compiled, the
    # host policy's payback rule kept a 16-prompt job from compiling the verify of K + 1 rows, and
    # the drafted step's machinery made its plain steps 7-8% slower (bench, SmolLM2, AMD EPYC Zen 3,
    # batch 1 and 8); eager, it ran 1.20x plain decoding (batch 1)
    jump_only = grammar is not None and recipe.draft.jump_forward and not recipe.draft.enabled and not compile
    host_k = recipe.draft.k_max if proposer is not None else JUMP_FORWARD_K if jump_only else 0
    step = UnifiedStep(target, draft, stochastic_drafts=recipe.draft.stochastic, use_kernel=use_kernel,
                       num_sms=num_sms, relaxed=relaxed, host_k=host_k,
                       host_drafts=proposer is not None,
                       logprobs=Logprobs(recipe.sampling.logprobs, recipe.sampling.logprobs_mode)
                       if recipe.sampling.logprobs is not None else None,
                       prompt_logprobs=recipe.sampling.prompt_logprobs, structured=structured)
    s = recipe.sampling
    sampling = SamplingTensors.build([s.temperature] * b, [s.top_k] * b, [s.top_p] * b,
                                     [s.min_p] * b, r.device)
    rules = StopRules(eos, tuple(s.stop), s.ignore_eos,
                      lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    if compile or r.device.type == "cpu":
        # an eager CPU run builds C++ kernels too (kernels/cpu_linear.py, cpu_attention.py): cached
        # there, once per machine
        use_compile_cache(cache_root() / "compiled")
    policy = None
    if (proposer is not None and recipe.draft.adaptive and draft is None) or jump_only:
        policy = HostDraftPolicy(step.k, horizon_tokens=expected_tokens)
    if draft is not None:
        dummy_draft = recipe.draft.load_format == "dummy" or _draft_inside_a_dummy_target(recipe)
        prior = acceptance_prior(r.draft_folder, step.k, dummy_draft)
        if recipe.draft.adaptive:
            policy = AdaptivePolicy(step.k, prior, horizon_tokens=expected_tokens,
                                    max_interval=max(FIRST_PROBE_INTERVAL, step.max_window - step.k - 1),
                                    max_window=step.max_window)
        if proposer is not None:      # a hybrid: per step and slot, the model's block or the host's
            estimator = None if recipe.draft.adaptive else AdaptivePolicy(step.k, prior)
            policy = HybridPolicy(policy or FixedPolicy(step.k), HostDraftPolicy(step.k, horizon_tokens=expected_tokens),
                                  estimator)
    runner = Runner(step, batch_size=b, max_seq_len=recipe.runtime.max_seq_len, rules=rules,
                    sampling=sampling, seed=seed, device=r.device, dtype=r.dtype, compile=compile,
                    reasoning=markers, policy=policy, proposer=proposer, grammar=grammar,
                    jump_forward=recipe.draft.jump_forward)
    k_part = f"K=auto (0..{step.k})" if recipe.draft.adaptive else f"K={step.k}"
    draft_part = f"draft {recipe.draft.method} {k_part}" if recipe.draft.enabled else "no draft"
    if jump_only:
        draft_part += f", the grammar's forced tokens verified as drafts (jump-forward, up to {step.k})"
    if relaxed is not None:
        draft_part += ", relaxed acceptance in reasoning (lossy)"
    device = torch.cuda.get_device_name(r.device) if r.device.type == "cuda" else "cpu"
    dtype = str(r.dtype).removeprefix("torch.")
    if recipe.target.dtype == "auto" and r.device.type == "cpu":
        dtype += (" (auto: compiled steps on AMX, where bf16 GEMMs are not known row-invariant)"
                  if dtype == "float32" and cpu_has_amx() and compile else
                  " (auto: the CPU multiplies bf16 natively)" if cpu_has_bf16() else
                  " (auto: AVX-512, bf16 converted in registers)" if dtype == "bfloat16" else
                  " (auto: eager steps, where bf16 converts on this CPU)" if cpu_has_avx512() else
                  " (auto: no AVX-512 on this CPU)")
    if draft is not None and r.draft_dtype != r.dtype:
        dtype += f", draft {str(r.draft_dtype).removeprefix('torch.')}"
    runner.header = (f"{device}, {dtype}, "
                     f"{threads} thread{'s' * (threads != 1)} ({why_threads}), "
                     f"compile {'on' if compile else 'off'} ({why_compile}), batch {b}, {draft_part}")
    runner.resolved = r          # the dtypes it runs in (eager steps may take others than `resolve`'s)
    return runner, tokenizer, notes


# The acceptance an adaptive K starts from when a draft has no card (a neutral guess the first
# measured blocks replace), and for random-init drafts (which accept almost nothing).
UNKNOWN_DRAFT_ACCEPTANCE = 0.5
RANDOM_DRAFT_ACCEPTANCE = 0.02


def acceptance_prior(draft_folder: Path | None, k_max: int, dummy: bool) -> list[float]:
    """Per-position acceptance to start from: the draft card's held-out figures (`training.json`,
    mean acceptance length at each K, written by `specgen train-draft`), else a neutral guess."""
    if dummy:
        return [RANDOM_DRAFT_ACCEPTANCE] * k_max
    card = draft_folder / "training.json" if draft_folder is not None else None
    lengths: dict[int, float] = {}
    if card is not None and card.is_file():
        try:
            for row in json.loads(card.read_text()).get("acceptance") or []:
                if row.get("k") and row.get("mean_acceptance_length"):
                    lengths[int(row["k"])] = float(row["mean_acceptance_length"])
        except (ValueError, TypeError, AttributeError, OSError):
            lengths = {}
    return per_position_prior(lengths) or [UNKNOWN_DRAFT_ACCEPTANCE] * k_max


def reasoning_markers(recipe: Recipe, tokenizer) -> ReasoningMarkers | None:
    """The tokenizer's reasoning markers when the recipe splits reasoning (`reasoning: auto` does
    where the tokenizer has them); a recipe that needs them from a tokenizer without is a JobError."""
    if recipe.reasoning is False:
        return None
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    markers = ReasoningMarkers.from_vocab(vocab)
    if markers is None:
        missing = f"the tokenizer has no {THINK_START} / {THINK_END} tokens (not a reasoning model)"
        if recipe.reasoning is True:
            raise InputError(f"recipe.reasoning: {missing}; set reasoning: auto or false")
        if recipe.sampling.relaxed_acceptance is not None:
            raise InputError(f"recipe.sampling.relaxed_acceptance: applies inside reasoning spans only, and "
                           f"{missing}; remove it")
    return markers


def attention_kernel_for(device: torch.device) -> tuple[bool, int]:
    """The Triton attention kernel on CUDA (per-row lengths, GQA packed), the reference elsewhere."""
    from specgen.kernels.keyed_noise import triton_available

    if device.type != "cuda" or not triton_available():
        return False, 1
    return True, torch.cuda.get_device_properties(device).multi_processor_count


def expected_tokens(records: list[PromptRecord], recipe: Recipe) -> int:
    """Output tokens a job produces at most (every prompt to its max_tokens)."""
    return sum(r.max_tokens or recipe.sampling.max_tokens for r in records if not r.error)


def expected_steps(records: list[PromptRecord], recipe: Recipe) -> int:
    """Decode steps a job takes at most (every prompt to its max_tokens, one token per step)."""
    return -(-expected_tokens(records, recipe) // recipe.runtime.batch_size)


def response_format_of(record: PromptRecord, recipe: Recipe) -> ResponseFormat | None:
    """The constraint a prompt's output takes: the line's own, else the recipe's (None: none)."""
    fmt = record.response_format or recipe.sampling.response_format
    return fmt if fmt is not None and fmt.constrains else None


def _requests(records: list[PromptRecord], tokenizer, recipe: Recipe) -> Iterator[Request]:
    for record in records:
        max_tokens = record.max_tokens or recipe.sampling.max_tokens
        if record.error:
            yield Request(record.id, [], max_tokens, 0, error=record.error)
            continue
        try:
            ids, start = tokenize_with_generation_start(
                record, tokenizer, recipe.chat_template and tokenizer.chat_template is not None,
                recipe.chat_template_kwargs)
        except Exception as err:  # a prompt the tokenizer rejects is that prompt's error only
            yield Request(record.id, [], max_tokens, 0, error=f"tokenisation failed: {err}")
            continue
        yield Request(record.id, ids, max_tokens, request_key(record.id), generation_start=start,
                      response_format=response_format_of(record, recipe))


def result_record(c: Completion) -> dict:
    return {
        "id": c.id, "text": c.text, "reasoning_text": c.reasoning_text, "token_ids": c.token_ids,
        "num_prompt_tokens": c.num_prompt_tokens, "num_output_tokens": len(c.token_ids),
        "num_reasoning_tokens": c.num_reasoning_tokens, "finish_reason": c.finish_reason, "error": c.error,
        "spec": c.spec.to_dict() if c.spec is not None else None,
        "logprobs": c.logprobs,
        "prompt_logprobs": c.prompt_logprobs,
    }


def run_job(recipe: Recipe, *, prompts: str | None = None, output: str | None = None,
            limit: int | None = None, resume: bool = True,
            on_start: Callable[[int, str, list[str]], None] | None = None,
            on_progress: Callable[[Progress], None] | None = None,
            on_status: Callable[[str], None] | None = None,
            world: World | None = None) -> JobSummary:
    """Run a recipe end to end. `on_start(total, header, notes)` fires once the models are loaded;
    `on_status(line)` reports the one-time warm-up.

    Under torchrun (`world`, default: from the environment) each rank takes the prompts whose ids
    hash to it (parallel/shards.py) and writes its own part; rank 0's `on_start` and `on_progress`
    count every rank's prompts, and rank 0 merges the parts and writes the statistics once every rank
    is done. The other ranks return their own figures and write no statistics."""
    started = time.perf_counter()
    world = World.from_env() if world is None else world
    try:
        world.check_tensor_parallel(recipe.runtime.tensor_parallel_size)
    except ValueError as err:
        raise InputError(str(err)) from None
    out_path = Path(output or recipe.output)
    check_output(out_path)
    check_output(stats_path(out_path))
    try:
        records = list(read_prompts(prompts or recipe.prompts, limit=limit))
    except PromptSourceError as err:
        raise InputError(str(err)) from err
    if world.distributed and torch.cuda.is_available() and recipe.runtime.device != "cpu":
        torch.cuda.set_device(world.local_rank)    # before anything asks CUDA (memory, contexts)
    r = resolve(recipe)
    memory = check_memory(recipe, r, ranks_here=world.local_size)
    joined_here = world.distributed and world.host_group is None
    world.start(r.device, recipe.runtime.tensor_parallel_size, recipe.runtime.expert_parallel)
    clean = False
    try:
        summary = _run_shard(recipe, r, world, records, out_path, memory, resume, started,
                             on_start, on_progress, on_status)
        clean = True
        return summary
    finally:
        if joined_here:
            world.stop(clean)


def _run_shard(recipe: Recipe, r: Resolved, world: World, records: list[PromptRecord], out_path: Path,
               memory: dict[str, int], resume: bool, started: float, on_start, on_progress,
               on_status) -> JobSummary:
    """`run_job` once the process group (if any) is joined: this rank's prompts, then the merge."""
    seed = recipe.sampling.seed if recipe.sampling.seed is not None else int.from_bytes(os.urandom(4), "little")
    seed = world.from_leader(seed)       # one job, one seed: the noise of an id is the same on any rank
    threads = world.cpu_share()
    if not resume and world.leader:
        remove_parts(out_path, from_rank=world.dp_size)   # an earlier run's; each copy empties its own
    done = finished_ids(out_path) if resume else set()  # also what any number of ranks wrote before
    done = world.from_tp_leader(done)    # a copy's ranks run one loop: the same prompts, whatever they read
    todo_everywhere = [rec for rec in records if rec.id not in done]
    # a copy of the target (one rank, or a block of tensor-parallel ranks) takes the ids hashed to it
    todo = [rec for rec in todo_everywhere if shard_of(rec.id, world.dp_size) == world.dp_rank]
    skipped = len(records) - len(todo_everywhere)
    shared = JobProgress(world) if world.distributed else None
    with (ResultWriter(part_path(out_path, world.dp_rank), resume=resume) if world.writes else _Discard()) as writer:
        try:
            runner, tokenizer, notes = build_runner(
                recipe, r, seed, expected_steps=expected_steps(todo, recipe),
                expected_tokens=expected_tokens(todo, recipe), threads=threads, tp=world.tp,
                structured=any(response_format_of(rec, recipe) is not None for rec in todo if not rec.error))
        except CheckpointError as err:     # the tokenizer, or weights that changed since the check
            raise InputError(str(err)) from err
        if world.tp.active:
            runner.header += f", tensor parallel: rank {world.tp.rank} of {world.tp.size}"
            if not isinstance(runner.policy, FixedPolicy):   # one k for the copy's ranks
                if isinstance(runner.policy, HybridPolicy) and not isinstance(runner.policy.model, FixedPolicy):
                    runner.policy.model = SharedDecisions(runner.policy.model, world)
                runner.policy = SharedDecisions(runner.policy, world)
        if world.dp_size > 1:
            runner.header += (f", data parallel: copy {world.dp_rank} of {world.dp_size} "
                              f"({len(todo)} of {len(todo_everywhere)} prompts)")
        if recipe.chat_template and tokenizer.chat_template is None:
            notes.append("the tokenizer has no chat template: prompts are used as plain text")
        if on_start is not None:
            on_start(len(todo_everywhere) if world.leader else len(todo), runner.header, notes)
        watch = _MismatchWatch(recipe, on_status)
        latest = Progress(0, 0, 0.0, SpecCounters(runner.unified.k))

        def on_finish(c: Completion) -> None:
            writer.write(result_record(c))

        def progress(p: Progress) -> None:
            nonlocal latest
            latest = p
            watch(p)
            if shared is not None and world.writes:
                shared.update(p)
            if on_progress is not None:
                on_progress(shared.combined(p) if shared is not None and world.leader else p)

        complete = False
        ranks: list[dict] | None = None
        try:
            runner.run(_requests(todo, tokenizer, recipe), on_finish, progress, on_status)
            if shared is not None:
                writer.sync()       # on disk before rank 0 may read it (a shared filesystem too)
                shared.finish(_rank_figures(world, runner) if world.writes else {})
                show = (lambda: on_progress(shared.combined(latest))) if on_progress and world.leader else None
                ranks = shared.wait_all(show)
            complete = True
        finally:
            notes += watch.notes
            if world.leader:
                writer.close()
                if complete:
                    merge_parts(out_path, [rec.id for rec in records])
                # Written after Ctrl-C too: the figures then cover the requests that finished
                # (under data parallel, those in the output: the parts merge on the next run).
                stats = _stats(recipe, r, seed, runner, complete, memory, notes,
                               time.perf_counter() - started, out_path, skipped)
                if ranks is not None:
                    stats = _with_ranks(stats, [f for f in ranks if f], world)
                write_json_atomic(stats_path(out_path), stats)
            else:
                stats = {"complete": complete, "data_parallel_rank": _rank_figures(world, runner)}
            runner.close()
    return JobSummary(out_path, stats_path(out_path), stats, skipped, notes)


class _Discard:
    """The results writer of a tensor-parallel rank that is not its copy's first: the first writes."""

    def write(self, record) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Discard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


def _rank_figures(world: World, runner: Runner) -> dict:
    """What one data-parallel copy did this run (rank 0 adds them up in the statistics)."""
    t: RunTotals = runner.totals
    return {"rank": world.rank, "copy": world.dp_rank, "requests": t.requests, "errors": t.errors, "output_tokens": t.output_tokens,
            "steps": t.steps, "prefill_calls": t.prefill_calls, "generation_seconds": t.wall_seconds,
            "compile_seconds": t.compile_seconds, "output_tokens_per_second": t.tokens_per_second,
            "steady_output_tokens_per_second": t.steady_tokens_per_second, "threads": torch.get_num_threads(),
            "k_steps": list(t.k_steps), "header": runner.header}


def _with_ranks(stats: dict, ranks: list[dict], world: World) -> dict:
    """Rank 0's statistics with this run's figures summed over every rank. The job's throughput is
    every rank's tokens over the slowest rank's time (what the job took), as a single process's is
    its tokens over its time."""
    tokens = sum(f["output_tokens"] for f in ranks)
    wall = max(f["generation_seconds"] for f in ranks)
    steady = max(f["generation_seconds"] - f["compile_seconds"] for f in ranks)
    k_steps = [0] * max((len(f["k_steps"]) for f in ranks), default=0)
    for f in ranks:
        for k, n in enumerate(f["k_steps"]):
            k_steps[k] += n
    return stats | {
        "this_run": dict(stats["this_run"], requests=sum(f["requests"] for f in ranks),
                         errors=sum(f["errors"] for f in ranks), output_tokens=tokens),
        "steps": sum(f["steps"] for f in ranks),
        "prefill_calls": sum(f["prefill_calls"] for f in ranks),
        "generation_seconds": wall,
        "compile_seconds": max(f["compile_seconds"] for f in ranks),
        "output_tokens_per_second": tokens / wall if wall > 0 else None,
        "steady_output_tokens_per_second": tokens / steady if steady > 0 else None,
        "threads": sum(f["threads"] for f in ranks) * world.tp.size,
        "speculation": dict(stats["speculation"], k_steps=k_steps),
        # a copy of the target per entry: one rank, or the first of a tensor-parallel block
        "data_parallel": {"ranks": len(ranks), "per_rank": ranks} if world.dp_size > 1 else None,
        "tensor_parallel_size": world.tp.size,
    }


class _MismatchWatch:
    """Says once when a draft that is not random accepts (almost) nothing over its first drafts."""

    def __init__(self, recipe: Recipe, on_status: Callable[[str], None] | None) -> None:
        # a host draft (suffix) proposes only where text repeats: little acceptance is no mismatch
        self.armed = recipe.draft.has_model and recipe.draft.load_format != "dummy" and \
            recipe.target.load_format != "dummy"
        self.on_status = on_status
        self.notes: list[str] = []

    def __call__(self, p: Progress) -> None:
        spec = p.totals
        if not self.armed or spec.num_drafts < MISMATCH_DRAFTS:
            return
        self.armed = False
        if spec.mean_acceptance_length < MISMATCH_LENGTH:
            note = (f"mean acceptance length {spec.mean_acceptance_length:.3f} over the first {spec.num_drafts} "
                    "drafts: the draft is probably mismatched with this target (made for another model or "
                    "tokenizer, or the wrong draft.method). Output is still exactly the target's.")
            self.notes.append(note)
            if self.on_status is not None:
                self.on_status(f"warning: {note}")


def _stats(recipe: Recipe, r: Resolved, seed: int, runner: Runner, complete: bool,
           memory: dict[str, int], notes: list[str], wall: float, out_path: Path, skipped: int) -> dict:
    """Counts and acceptance over every record in the output (a resumed run's earlier ones too);
    throughput, steps and timings of this run (`this_run` says how much of the output it made)."""
    import transformers

    totals: RunTotals = runner.totals
    every = output_totals(out_path, runner.unified.k)
    return {
        "complete": complete,
        "requests": every["requests"],
        "errors": every["errors"],
        "output_tokens": every["output_tokens"],
        "prompt_tokens": every["prompt_tokens"],
        "this_run": {"requests": totals.requests, "errors": totals.errors, "output_tokens": totals.output_tokens,
                     "resumed_past": skipped},
        # records written with another K (a recipe changed between runs); `spec` adds them in
        "spec_records_of_another_k": every["records_of_another_k"],
        "steps": totals.steps,
        "prefill_calls": totals.prefill_calls,
        # prompts the draft did not read, drafting being ruled out when they came (policy.py)
        "unabsorbed_prompts": totals.unabsorbed_prompts,
        "generation_seconds": totals.wall_seconds,
        "compile_seconds": totals.compile_seconds,
        "wall_seconds": wall,
        "output_tokens_per_second": totals.tokens_per_second,
        "steady_output_tokens_per_second": totals.steady_tokens_per_second,
        "compiled": runner.compiled,
        "threads": torch.get_num_threads(),
        "header": runner.header,
        "spec": every["spec"].to_dict(),
        # how this run chose k: steps per k (0 = plain), and the adaptive policy's estimates
        "speculation": {"k_steps": totals.k_steps, **runner.policy.summary()},
        # structured output: the host's share of a step (reading the drafts, the grammar's masks)
        "structured": {"mask_ms_per_step": 1000 * totals.mask_seconds / max(1, totals.steps),
                       "step_ms": 1000 * totals.step_seconds / max(1, totals.steps),
                       # drafts the grammar wrote in place of refused ones (draft.jump_forward), and
                       # slot-steps whose drafts stopped at a refused one it could not replace
                       "grammar_draft_tokens": totals.grammar_drafts,
                       "refused_draft_steps": totals.refused_drafts}
        if runner.grammar is not None else None,
        "seed": seed,
        "recipe": recipe.to_dict(),
        "notes": notes,
        "memory_estimate_bytes": memory,
        "device": _device_name(r.device),
        "dtype": str(runner.resolved.dtype).removeprefix("torch."),
        "draft_dtype": str(runner.resolved.draft_dtype).removeprefix("torch.") if recipe.draft.has_model else None,
        "versions": {"specgen": _version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
    }


def output_totals(path: Path, k: int) -> dict:
    """Requests, errors, tokens and acceptance counters summed over the records of an output file."""
    out = {"requests": 0, "errors": 0, "output_tokens": 0, "prompt_tokens": 0, "spec": SpecCounters(k),
           "records_of_another_k": 0}
    if not path.exists():
        return out
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                record = json.loads(line)
                out["requests"] += 1
                out["errors"] += record.get("finish_reason") == "error"
                out["output_tokens"] += int(record.get("num_output_tokens") or 0)
                out["prompt_tokens"] += int(record.get("num_prompt_tokens") or 0)
                spec = record.get("spec")
                if spec is None:
                    continue
                counters = SpecCounters.from_dict(spec)
            except (ValueError, TypeError, KeyError, AttributeError):
                continue       # a torn last line of a killed run (cut on resume), or a foreign line
            # a record written with another K (a changed recipe) adds in: per-position counts say
            # how many drafts reached each position
            out["records_of_another_k"] += counters.num_speculative_tokens != k
            out["spec"].merge(counters)
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specgen")
    except PackageNotFoundError:
        return "unknown"
