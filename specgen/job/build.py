"""Loading the models and binding them into a Runner.

Contract: `build_runner(recipe, resolved, seed, ...)` -> (runner, tokenizer, notes): the CPU threads,
whether compiling pays (`decide_compile`: the job's expected steps against measured compile
times), the target and the draft (or the host proposer: suffix drafts, jump-forward), the grammar
engine, relaxed acceptance, the unified step, the K policy (fixed, adaptive from the draft card's
prior (`acceptance_prior`), host, hybrid) and the runner's one-line `header` saying what runs
where. `notes` are what the user should know (dummy weights, text-only loads, lossy settings).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from specgen.checkpoints.loading import load_draft, load_target, target_config, unread_tensor_groups
from specgen.checkpoints.gguf_blocks import published_blocks, published_formats
from specgen.checkpoints.store import cache_root
from specgen.checkpoints.tokenizer import load_tokenizer
from specgen.drafts.forced import JUMP_FORWARD_K
from specgen.drafts.suffix import SuffixProposer
from specgen.job.errors import InputError
from specgen.job.resolved import (
    DTYPES, Resolved, auto_dtype, draft_dtype, draft_inside_a_dummy_target, gguf_blocks_kept, keeps_fp8, keeps_int4,
    kept_quantization, read_suffix_history, shares_target_head)
from specgen.machine import choose_threads, cpu_has_amx, cpu_has_avx512, cpu_has_bf16
from specgen.models.quantized import quantize_target
from specgen.models.tensor_parallel import TensorParallel
from specgen.pipelines.compiled import freezes, use_compile_cache
from specgen.pipelines.host_policy import HostDraftPolicy
from specgen.pipelines.hybrid_policy import HybridPolicy
from specgen.pipelines.logprobs import Logprobs
from specgen.pipelines.policy import AdaptivePolicy, FIRST_PROBE_INTERVAL, FixedPolicy, per_position_prior
from specgen.pipelines.reasoning import ReasoningMarkers, THINK_END, THINK_START
from specgen.pipelines.relaxed import RelaxedAcceptance
from specgen.pipelines.runner import Runner
from specgen.pipelines.stops import StopRules, eos_ids_from
from specgen.pipelines.unified import UnifiedStep
from specgen.recipe import Recipe
from specgen.registry import DRAFT_METHODS
from specgen.sampling import SamplingTensors
from specgen.structured.grammar import GrammarEngine


# CPU, `runtime.compile: auto`: compile only a job long enough to win the compile time back.
# Measured on 2 cores (SmolLM2, batch 1): with frozen weights (every step up to 64 rows, see
# pipelines/compiled.py) compiling takes 50-70 s each run (frozen graphs miss Inductor's graph
# cache; its kernels and autotuning results are cached) and saves ~40 ms of a ~65 ms eager step.
# Without (larger steps) ~15 s, 10 s once Inductor's disk cache holds it, and saves ~18 ms of ~130.
CPU_COMPILE_MIN_STEPS = {"frozen": 1800, "not frozen": 800}


def quantize_on_load(target, recipe: Recipe, r: Resolved, keep_dense_head: bool | None = None) -> None:
    """`target.quantization` applied to a loaded target (models/quantized.quantize_target): a GGUF's own
    4-bit blocks kept (auto, int4), the rest as the recipe asks. `keep_dense_head`: default, whether
    the recipe's draft reads the target's head (bench shares one target among several drafts)."""
    kind = kept_quantization(recipe, r.target_config)
    source = gguf_blocks_kept(recipe, r.target_config, r.device)
    if kind is None and source is None:
        return
    published = published_blocks(source, r.target_config) if source is not None else None
    if keep_dense_head is None:
        keep_dense_head = shares_target_head(recipe)
    quantize_target(target, kind, published=published, keep_dense_head=keep_dense_head)


def quantization_note(recipe: Recipe, r: Resolved) -> str:
    """The header's words for what `quantize_on_load` keeps ("" where nothing)."""
    kind = kept_quantization(recipe, r.target_config)
    source = gguf_blocks_kept(recipe, r.target_config, r.device)
    if source is not None:
        formats = sorted({fmt for fmt, _ in published_formats(source).values()})
        rest = f", the rest {kind}" if kind else ""
        return f", the GGUF's {'/'.join(formats)} blocks kept (target.quantization{rest})"
    return f", {kind} weights (target.quantization)" if kind else ""


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
                             dummy=dummy_target, tp=tp, keep_fp8=keeps_fp8(recipe, r.device),
                             keep_int4=keeps_int4(recipe, r.target_config, r.device))
        quantize_on_load(target, recipe, r)
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
        dummy = recipe.draft.load_format == "dummy" or draft_inside_a_dummy_target(recipe)
        draft = load_draft(recipe.draft.model_method, r.draft_config or builder.dummy_config(target.shape),
                           r.draft_folder, target, num_speculative_tokens=recipe.draft.k_max,
                           dtype=r.draft_dtype, device=r.device, dummy=dummy)
        if draft_inside_a_dummy_target(recipe):
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
        dummy_draft = recipe.draft.load_format == "dummy" or draft_inside_a_dummy_target(recipe)
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
    dtype += quantization_note(recipe, r)
    if keeps_int4(recipe, r.target_config, r.device):
        dtype += ", routed experts INT4 as published"
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
