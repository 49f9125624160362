"""Recipe schema: YAML in, one validated `Recipe` out.

Contract:
- `load_recipe(path, overrides)` reads a YAML mapping, merges `--set a.b=value` overrides (each value
  parsed as YAML, so lists, numbers, booleans and `null` work), validates everything and returns a
  `Recipe` whose defaults are filled in. `recipe_from_dict` and `apply_overrides` are the two halves,
  callable on their own.
- Every problem is a `RecipeError` whose lines read `recipe.<dotted.path>: <problem>`; all problems
  found are reported together, one per line. Unknown keys are errors at every level, so a typo never
  silently falls back to a default.
- Nothing here imports torch: the CLI validates a recipe before any model is loaded, so `dtype: auto`
  and `device: auto` stay unresolved here and are decided by the loader.
- Paths in a recipe (`target.model`, `draft.model`, `prompts`, `output`) are taken as written: relative
  paths are relative to the current working directory, NOT to the recipe's folder. Only the default
  `output` uses the recipe file, by its stem: `outputs/<stem>.jsonl`.

The speculative section uses vLLM's vocabulary (`method`, `model`, `num_speculative_tokens`).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specgen.registry import DRAFT_METHODS as _REGISTERED, METHOD_NAMES, method_parts
from specgen.structured.formats import FormatError, ResponseFormat, parse_response_format

# Draft methods come from the one registry (specgen/registry.py).
DRAFT_METHODS: tuple[str, ...] = METHOD_NAMES
# Methods whose checkpoint can live inside the target's (DeepSeek-style MTP layers): no draft.model needed.
DRAFT_IN_TARGET = tuple(m.name for m in _REGISTERED.values() if m.lives_in_target)
# Methods whose draft decides the default K itself (DFlash: block_size - 1).
K_FROM_DRAFT = tuple(m.name for m in _REGISTERED.values() if m.k_from_draft)
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_NUM_SPECULATIVE_TOKENS = 3
# `num_speculative_tokens: auto` chooses k per step in 0..max_speculative_tokens; this is its default
# for chained drafts (EAGLE-3, MTP). A DFlash draft's own block_size - 1 is its default.
DEFAULT_MAX_SPECULATIVE_TOKENS = 4
MAX_NUM_SPECULATIVE_TOKENS = 32


class RecipeError(ValueError):
    """A recipe problem, located by a dotted path ("" for the recipe as a whole).

    `path` and `problem` describe the first problem; `problems` lists all of them.
    """

    def __init__(self, path: str, problem: str, more: Sequence[tuple[str, str]] = ()) -> None:
        self.path = path
        self.problem = problem
        self.problems: list[tuple[str, str]] = [(path, problem), *more]
        super().__init__("\n".join(_format(p, m) for p, m in self.problems))


def _format(path: str, problem: str) -> str:
    return f"recipe.{path}: {problem}" if path else f"recipe: {problem}"


@dataclass(frozen=True, slots=True)
class TargetSpec:
    model: str
    dtype: str = "auto"  # auto = bfloat16 on CUDA and AVX-512 CPUs, else float32 (job.auto_dtype)
    load_format: str = "auto"  # dummy = random weights from config.json alone
    # config.json fields replaced before anything is built (vLLM's hf_overrides; nested dicts merge):
    # e.g. {num_hidden_layers: 5} times the real DeepSeek-V3 layer shapes on one GPU with dummy weights
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # block-FP8 checkpoints (DeepSeek-V3): keep = weights stay FP8, multiplied block-scaled
    # (kernels/block_fp8.py); dequantize = to the run's dtype at load; auto = keep on GPUs with FP8
    # tensor cores (compute capability 8.9+), dequantize elsewhere
    fp8_weights: str = "auto"
    # weight-only quantization kept for the run (models/quantized.py): int8 (a code per weight, a scale
    # per row) or int4 (group-wise 32, symmetric); auto = the checkpoint's own, else none. CPU targets
    # of the Llama family for now, eager or compiled; the drafts stay in their dtype
    quantization: str = "auto"


@dataclass(frozen=True, slots=True)
class DraftSpec:
    method: str = "none"
    model: str | None = None  # ignored when method is "none"
    load_format: str = "auto"  # dummy = deterministic random-init draft (demo only)
    # K: an integer pins it; "auto" lets the runner choose k in 0..max_speculative_tokens per step
    # (pipelines/policy.py). Filled with 3 when a draft is used and none is given.
    num_speculative_tokens: int | str | None = None
    stochastic: bool = False  # sample drafts from q and use full rejection sampling
    max_speculative_tokens: int | None = None  # auto only: the largest k (None: the method's default)
    # The draft only proposes, so its precision changes how often it is right, never what is kept:
    # auto = bfloat16 where the target's auto takes it (job.auto_dtype), else the target's; a bf16 draft beside
    # a float32 target keeps the target's exact output (job.draft_dtype).
    dtype: str = "auto"
    # suffix (alone or in a hybrid): a results file of an earlier run whose answers the job-wide index
    # starts from (opt-in: otherwise nothing crosses runs)
    suffix_history: str | None = None
    # structured output: a draft the grammar refuses gives way to the tokens the grammar forces from
    # there (a JSON key, its quotes and colon; argmax drafts only), host drafts (suffix, and plain
    # decoding's eager steps) include them. Exact either way (the verify decides).
    jump_forward: bool = True

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def model_method(self) -> str | None:
        """The draft model's method (`eagle3` of `eagle3+suffix`); None: no draft model runs."""
        return method_parts(self.method)[0]

    @property
    def host_method(self) -> str | None:
        """The method proposing on the host (`suffix`, alone or in a hybrid); None: none does."""
        return method_parts(self.method)[1]

    @property
    def has_model(self) -> bool:
        """A draft model runs beside the target (not plain decoding, not a host-side method alone)."""
        return self.model_method is not None

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def k_max(self) -> int | None:
        """The most tokens one step drafts (None: the draft decides, DFlash's block_size - 1)."""
        if self.adaptive:
            return self.max_speculative_tokens
        return self.num_speculative_tokens  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class RelaxedAcceptanceSpec:
    """LOSSY, opt-in: inside reasoning spans, accept a draft the target ranks in its top_k and within
    delta of its top-1 probability (TensorRT-LLM's published setting: 10 and 0.6)."""

    top_k: int = 10
    delta: float = 0.6


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off (-1 is accepted in a recipe and stored as 0)
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    relaxed_acceptance: RelaxedAcceptanceSpec | None = None  # None = strict (lossless) everywhere
    logprobs: int | None = None  # the target's logprobs of each output token and its top-N (None = off)
    logprobs_mode: str = "processed"  # processed (after temperature / top-k / top-p / min-p) | raw
    prompt_logprobs: int | None = None  # the target's logprobs of each prompt token and its top-N (None = off)
    response_format: ResponseFormat | None = None  # the outputs' constraint (specgen/structured/formats.py)


@dataclass(frozen=True, slots=True)
class RuntimeSpec:
    device: str = "auto"
    batch_size: int = 8
    max_seq_len: int = 2048
    compile: bool | None = None  # None = auto: on CUDA; on CPU when the job is long enough to pay back
    threads: int | None = None  # None = auto: the CPUs not busy with other work
    tensor_parallel_size: int = 1  # ranks (of a torchrun job) that split the target's layers between them
    expert_parallel: bool = False  # MoE targets: those ranks hold whole routed experts (else each expert's rows)


@dataclass(frozen=True, slots=True)
class TrainSpec:
    """`specgen train-draft`: how to train the recipe's draft (written to `draft.model`)."""

    prompts: int = 2000               # train-split ShareGPT prompts the target answers (self-distillation)
    skip_prompts: int = 0             # train-split prompts passed over first (a later sitting takes new ones)
    later_turns: int = 0              # plus this many later human turns, the conversation so far as context
    skip_later_turns: int = 0         # later turns passed over first (as skip_prompts)
    init_from: str | None = None      # a trained draft folder of the same method to start from (None = random)
    answer_tokens: int = 256          # max tokens of each answer
    max_prompt_chars: int = 1500      # longer prompts are skipped (a later turn: with its context)
    generation_batch_size: int = 96
    dataset_answers: float = 0.0      # plus ShareGPT's own replies (off-policy), this many per target answer
    generation_dtype: str = "auto"    # the target's dtype for the answers: auto = train.dtype's choice
    feature_cache: bool = False       # target features computed once per sequence, kept on disk (bf16)
    dtype: str = "auto"               # target features and autocast: auto = bfloat16 where the CPU has it
    heldout_prompts: int = 64         # held-out answers for top-1 agreement while training
    epochs: float = 2.0
    batch_size: int = 8               # sequences per optimizer step
    max_seq_len: int = 640            # prompt + answer tokens kept per sequence
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1         # cosine decay ends at learning_rate * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    ttt_steps: int = 5                # eagle3, mtp: unrolled chain passes
    ttt_decay: float = 0.8            # eagle3, mtp: loss weight of pass i is ttt_decay ** i
    draft_vocab_size: int = 8192      # most frequent answer tokens the draft scores (d2t / t2d)
    soft_labels: float = 0.0          # weight of the target's distribution as label (0 = its greedy token only)
    head_init: str = "random"         # eagle3: a new draft's head, random or the target's head rows (its d2t rows)
    keep_vocabulary: bool = False     # mtp, dflash: a warm start keeps its draft's vocabulary (else chosen again)
    layers: int = 2                   # dflash: draft layers
    block_size: int = 8               # dflash: anchor + K masks
    anchors: int = 32                 # dflash: blocks per sequence
    loss_gamma: float | None = None   # dflash: position weights exp(-(i - 1) / gamma); None = block_size // 2
    mask_token_id: int | None = None  # dflash: the mask row; None = one that means nothing (an unused row, a special token)
    feature_layers: int | None = None  # dflash: target layers read; None = 5 (the published drafts)
    checkpoint_every: int = 50        # optimizer steps between checkpoints (resume after a kill)
    eval_every: int = 50              # optimizer steps between held-out agreement measurements
    eval_prompts: int = 24            # held-out prompts of the final acceptance measurement
    eval_ks: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    eval_prompt_sets: list[str] = field(default_factory=list)   # more JSONL prompt files the card measures
    eval_max_tokens: int = 128
    export_dtype: str = "bfloat16"
    seed: int = 0


# Which train fields apply to which draft method only.
TRAIN_FIELDS_OF = {"ttt_steps": ("eagle3", "mtp"), "ttt_decay": ("eagle3", "mtp"),
                   "layers": ("dflash",), "block_size": ("dflash",),
                   "anchors": ("dflash",), "loss_gamma": ("dflash",), "mask_token_id": ("dflash",),
                   "feature_layers": ("dflash",), "head_init": ("eagle3",),
                   "keep_vocabulary": ("mtp", "dflash")}


@dataclass(frozen=True, slots=True)
class Recipe:
    target: TargetSpec
    draft: DraftSpec = field(default_factory=DraftSpec)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    runtime: RuntimeSpec = field(default_factory=RuntimeSpec)
    prompts: str = "default"  # "default", "sharegpt", or a path to a .jsonl file
    output: str = "outputs/recipe.jsonl"  # always resolved; see recipe_from_dict
    chat_template: bool = True
    # extra variables for the chat template, e.g. {thinking: false} (Kimi K2.5's instant mode)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # split `<think>` reasoning from the text: None = auto (when the tokenizer has the markers)
    reasoning: bool | None = None
    train: TrainSpec | None = None  # only `specgen train-draft` reads it
    source: Path | None = None  # the recipe file, when there is one

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as JSON-serialisable data; `recipe_from_dict` accepts it back."""
        data = asdict(self)
        del data["source"]  # provenance, not a recipe field: kept out so the round trip validates
        if data["train"] is None:
            del data["train"]
        else:  # fields of other methods are errors in a recipe: keep them out too
            for key, methods in TRAIN_FIELDS_OF.items():
                if self.draft.model_method not in methods:
                    del data["train"][key]
        return data


# --- loading and overrides -------------------------------------------------------------------


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read a YAML recipe, apply `--set` overrides, validate. Raises RecipeError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise RecipeError("", f"cannot read {path}: {reason}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError("", f"cannot read {path}: not valid YAML: {exc}") from exc
    if data is None:  # an empty file: everything may still come from overrides
        data = {}
    if not isinstance(data, dict):
        raise RecipeError("", f"cannot read {path}: expected a mapping at the top, got {_show(data)}")
    return recipe_from_dict(apply_overrides(data, overrides), source=path)


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of `data` with each `a.b=value` set; the value is parsed as YAML.

    Missing sections are created, so `draft.method=eagle3` works on a recipe without `draft:`.
    """
    result = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or any(not part for part in parts):
            raise RecipeError("", f"bad override {item!r}: expected key=value, e.g. sampling.temperature=0.7")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise RecipeError(key, f"cannot parse override value {raw!r} as YAML: {exc}") from exc
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:  # `draft:` written with nothing under it
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise RecipeError(where, f"cannot set {key}: {where} is not a mapping")
            node = child
        node[parts[-1]] = value
    return result


# --- validation ------------------------------------------------------------------------------


class _Bad(Exception):
    """One field's problem; collected by _Checker so all problems are reported together."""


def _show(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _string(value: object) -> str:
    if not isinstance(value, str):
        raise _Bad(f"expected a string, got {_show(value)}")
    if not value:
        raise _Bad("must not be empty")
    return value


def _boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"expected true or false, got {_show(value)}")
    return value


def _integer(lo: int | None = None, hi: int | None = None) -> Callable[[object], int]:
    def parse(value: object) -> int:
        # bool is a subclass of int in Python, but `batch_size: true` is a mistake, not a 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad(f"expected an integer, got {_show(value)}")
        if lo is not None and value < lo:
            raise _Bad(f"must be >= {lo}")
        if hi is not None and value > hi:
            raise _Bad(f"must be <= {hi}")
        return value

    return parse


_EXPONENT_ONLY = re.compile(r"[+-]?\d+(\.\d*)?[eE][+-]?\d+")


def _number(value: object) -> float:
    # YAML 1.1 (PyYAML) reads `1e-3` as a string (it wants `1.0e-3`); take it as the number it is.
    if isinstance(value, str) and _EXPONENT_ONLY.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Bad(f"expected a number, got {_show(value)}")
    return float(value)


def _choice(options: Sequence[str]) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if value not in options:
            raise _Bad(f"must be one of {', '.join(options)}")
        return value  # type: ignore[return-value]

    return parse


def _auto_or(parse: Callable[[object], Any]) -> Callable[[object], Any]:
    """`auto` (or null) -> None, anything else through `parse`."""
    return lambda value: None if value is None or value == "auto" else parse(value)


def _auto_kept(parse: Callable[[object], Any]) -> Callable[[object], Any]:
    """`auto` stays "auto" (null -> None), anything else through `parse`."""

    def parse_or_auto(value: object) -> Any:
        if value is None or value == "auto":
            return value
        if isinstance(value, str):
            raise _Bad(f"expected an integer or auto, got {_show(value)}")
        return parse(value)

    return parse_or_auto


def _switch(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Bad(f"expected true, false or auto, got {_show(value)}")
    return value


def _string_keyed(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _Bad(f"expected a mapping of config.json fields, got {_show(value)}")
    return dict(value)


def _optional(parse: Callable[[object], Any]) -> Callable[[object], Any]:
    return lambda value: None if value is None else parse(value)


def _in_range(parse: Callable[[object], float], ok: Callable[[float], bool], problem: str):
    def check(value: object) -> float:
        number = parse(value)
        if not ok(number):
            raise _Bad(problem)
        return number

    return check


_MISSING = object()


class _Checker:
    """Reads sections and fields, recording each problem with its path instead of stopping."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def section(self, data: Mapping[str, Any], name: str, known: Sequence[str]) -> dict[str, Any] | None:
        """The section's mapping; None when it is not one (its fields are then not checked)."""
        value = data.get(name)
        if value is None:  # absent, or `draft:` with nothing under it: all defaults
            return {}
        if not isinstance(value, dict):
            self.problems.append((name, f"expected a mapping, got {_show(value)}"))
            return None
        self.unknown(value, name, known)
        return value

    def unknown(self, data: Mapping[str, Any], prefix: str, known: Sequence[str]) -> None:
        for key in data:
            if key not in known:
                path = f"{prefix}.{key}" if prefix else str(key)
                self.problems.append((path, f"unknown key (known: {', '.join(known)})"))

    def get(
        self, data: Mapping[str, Any] | None, path: str, parse: Callable[[object], Any], default: Any = _MISSING
    ) -> Any:
        key = path.rpartition(".")[2]
        if data is None:  # the section itself was wrong and already reported
            return None if default is _MISSING else default
        if key not in data:
            if default is _MISSING:
                self.problems.append((path, "required"))
            return None if default is _MISSING else default
        try:
            return parse(data[key])
        except _Bad as exc:
            self.problems.append((path, str(exc)))
            return None if default is _MISSING else default


def _response_format(check: _Checker, sampling: Mapping[str, Any] | None) -> ResponseFormat | None:
    try:
        return parse_response_format((sampling or {}).get("response_format"), "sampling.response_format")
    except FormatError as err:
        check.problems.append((err.place, err.problem))
        return None


def _stop_list(check: _Checker, sampling: Mapping[str, Any] | None) -> list[str]:
    value = (sampling or {}).get("stop", [])
    if isinstance(value, str):  # a single stop string is the common case; accept it bare
        value = [value]
    if not isinstance(value, list):
        check.problems.append(("sampling.stop", f"expected a string or a list of strings, got {_show(value)}"))
        return []
    stops: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            check.problems.append((f"sampling.stop[{i}]", f"expected a string, got {_show(item)}"))
        elif not item:
            # An empty stop string would match everywhere and end every request at once.
            check.problems.append((f"sampling.stop[{i}]", "must not be empty"))
        else:
            stops.append(item)
    return stops


def _default_output(source: Path | None) -> str:
    return f"outputs/{source.stem if source is not None else 'recipe'}.jsonl"


_TOP = ("target", "draft", "sampling", "runtime", "prompts", "output", "chat_template",
        "chat_template_kwargs", "reasoning", "train")
_TRAIN = tuple(TrainSpec.__dataclass_fields__)
FP8_WEIGHTS = ("auto", "keep", "dequantize")
QUANTIZATIONS = ("auto", "none", "int8", "int4")     # target.quantization (models/quantized.py)
_TARGET = ("model", "dtype", "load_format", "hf_overrides", "fp8_weights", "quantization")
_DRAFT = ("method", "model", "load_format", "num_speculative_tokens", "stochastic", "max_speculative_tokens",
          "dtype", "suffix_history", "jump_forward")
LOGPROBS_MODES = ("processed", "raw")    # pipelines/logprobs.py
LOGPROBS_MAX_TOP = 20                   # vLLM's default cap on top logprobs
_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "stop", "ignore_eos",
             "relaxed_acceptance", "logprobs", "logprobs_mode", "prompt_logprobs", "response_format")
_RELAXED = ("top_k", "delta")
_RUNTIME = ("device", "batch_size", "max_seq_len", "compile", "threads", "tensor_parallel_size", "expert_parallel")


def recipe_from_dict(data: Mapping[str, Any], source: Path | None = None) -> Recipe:
    """Validate plain recipe data (as read from YAML) into a Recipe. Raises RecipeError.

    `source` is the recipe file; it only names the default output (`outputs/<stem>.jsonl`,
    or `outputs/recipe.jsonl` without a source).
    """
    if not isinstance(data, Mapping):
        raise RecipeError("", f"expected a mapping at the top, got {_show(data)}")
    check = _Checker()
    check.unknown(data, "", _TOP)

    t = check.section(data, "target", _TARGET)
    target = TargetSpec(
        model=check.get(t, "target.model", _string),
        dtype=check.get(t, "target.dtype", _choice(DTYPES), "auto"),
        load_format=check.get(t, "target.load_format", _choice(LOAD_FORMATS), "auto"),
        hf_overrides=check.get(t, "target.hf_overrides", _optional(_string_keyed), None) or {},
        fp8_weights=check.get(t, "target.fp8_weights", _choice(FP8_WEIGHTS), "auto"),
        quantization=check.get(t, "target.quantization", _choice(QUANTIZATIONS), "auto"),
    )

    d = check.section(data, "draft", _DRAFT)
    method = check.get(d, "draft.method", _choice(DRAFT_METHODS), "none")
    draft_model = check.get(d, "draft.model", _optional(_string), None)
    draft_format = check.get(d, "draft.load_format", _choice(LOAD_FORMATS), "auto")
    k = check.get(d, "draft.num_speculative_tokens", _auto_kept(_integer(1, MAX_NUM_SPECULATIVE_TOKENS)), None)
    k_max = check.get(d, "draft.max_speculative_tokens", _optional(_integer(1, MAX_NUM_SPECULATIVE_TOKENS)), None)
    if k_max is not None and k != "auto":
        check.problems.append(("draft.max_speculative_tokens", "only applies to num_speculative_tokens: auto (null when K is pinned)"))
    model_method, host_method = method_parts(method)
    if method != "none":
        if k is None and model_method not in K_FROM_DRAFT:
            k = DEFAULT_NUM_SPECULATIVE_TOKENS
        if k == "auto" and k_max is None and model_method not in K_FROM_DRAFT:
            k_max = DEFAULT_MAX_SPECULATIVE_TOKENS
        # A dummy draft is built from the target's shape alone, so only a real one needs a checkpoint.
        needs_model = draft_format != "dummy" and model_method is not None and model_method not in DRAFT_IN_TARGET
        if draft_model is None and needs_model and "draft.model" not in dict(check.problems):
            check.problems.append(("draft.model", f"required when method is {method} (or set load_format: dummy)"))
    draft = DraftSpec(
        method=method,
        model=draft_model,
        load_format=draft_format,
        num_speculative_tokens=k,
        stochastic=check.get(d, "draft.stochastic", _boolean, False),
        max_speculative_tokens=k_max,
        dtype=check.get(d, "draft.dtype", _choice(DTYPES), "auto"),
        suffix_history=check.get(d, "draft.suffix_history", _optional(_string), None),
        jump_forward=check.get(d, "draft.jump_forward", _boolean, True),
    )
    # (kept without a draft: the same recipe runs plain with `--set draft.method=none`, as bench's ar)
    if draft.suffix_history is not None and host_method is None and method != "none":
        check.problems.append(("draft.suffix_history", f"applies to suffix drafting only (draft.method is {method})"))
    if draft.stochastic and host_method is not None:
        check.problems.append(("draft.stochastic", f"applies to draft models only ({host_method} proposes "
                                                   "tokens, not distributions)"))

    s = check.section(data, "sampling", _SAMPLING)
    top_k = check.get(s, "sampling.top_k", _integer(-1), 0)
    sampling = SamplingSpec(
        temperature=check.get(
            s, "sampling.temperature", _in_range(_number, lambda x: x >= 0, "must be >= 0"), 0.0
        ),
        top_k=0 if top_k == -1 else top_k,  # one spelling of "off" downstream
        top_p=check.get(
            s, "sampling.top_p", _in_range(_number, lambda x: 0 < x <= 1, "must be > 0 and <= 1"), 1.0
        ),
        min_p=check.get(
            s, "sampling.min_p", _in_range(_number, lambda x: 0 <= x <= 1, "must be >= 0 and <= 1"), 0.0
        ),
        seed=check.get(s, "sampling.seed", _optional(_integer(0)), None),
        max_tokens=check.get(s, "sampling.max_tokens", _integer(1), 256),
        stop=_stop_list(check, s),
        ignore_eos=check.get(s, "sampling.ignore_eos", _boolean, False),
        relaxed_acceptance=_relaxed_acceptance(check, s),
        logprobs=check.get(s, "sampling.logprobs", _optional(_integer(0, LOGPROBS_MAX_TOP)), None),
        logprobs_mode=check.get(s, "sampling.logprobs_mode", _choice(LOGPROBS_MODES), "processed"),
        prompt_logprobs=check.get(s, "sampling.prompt_logprobs", _optional(_integer(0, LOGPROBS_MAX_TOP)), None),
        response_format=_response_format(check, s),
    )

    r = check.section(data, "runtime", _RUNTIME)
    runtime = RuntimeSpec(
        device=check.get(r, "runtime.device", _choice(DEVICES), "auto"),
        batch_size=check.get(r, "runtime.batch_size", _integer(1), 8),
        max_seq_len=check.get(r, "runtime.max_seq_len", _integer(16), 2048),
        compile=check.get(r, "runtime.compile", _auto_or(_switch), None),
        threads=check.get(r, "runtime.threads", _auto_or(_integer(1)), None),
        tensor_parallel_size=check.get(r, "runtime.tensor_parallel_size", _integer(1), 1),
        expert_parallel=check.get(r, "runtime.expert_parallel", _boolean, False),
    )
    if runtime.expert_parallel and runtime.tensor_parallel_size < 2:
        check.problems.append(("runtime.expert_parallel", "spreads routed experts over the tensor-parallel ranks: "
                                                          "set runtime.tensor_parallel_size >= 2 too"))

    train = _train_spec(check, data, method, draft_model)

    prompts = check.get(data, "prompts", _string, "default")
    output = check.get(data, "output", _optional(_string), None)
    chat_template = check.get(data, "chat_template", _boolean, True)
    template_kwargs = check.get(data, "chat_template_kwargs", _optional(_variables), None) or {}
    reasoning = check.get(data, "reasoning", _auto_or(_switch), None)
    if reasoning is False and sampling.relaxed_acceptance is not None:
        check.problems.append(("sampling.relaxed_acceptance", "applies inside reasoning spans only, and "
                                                              "reasoning is false"))

    if check.problems:
        (path, problem), *more = check.problems
        raise RecipeError(path, problem, more)
    return Recipe(
        target=target,
        draft=draft,
        sampling=sampling,
        runtime=runtime,
        prompts=prompts,
        output=output if output is not None else _default_output(source),
        chat_template=chat_template,
        chat_template_kwargs=template_kwargs,
        reasoning=reasoning,
        train=train,
        source=source,
    )


def _variables(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _Bad(f"expected a mapping of template variables, e.g. {{thinking: false}}, got {_show(value)}")
    return dict(value)


def _relaxed_acceptance(check: _Checker, sampling: Mapping[str, Any] | None) -> RelaxedAcceptanceSpec | None:
    value = (sampling or {}).get("relaxed_acceptance")
    if value is None:
        return None
    path = "sampling.relaxed_acceptance"
    if not isinstance(value, dict):
        check.problems.append((path, f"expected a mapping {{top_k, delta}} or null, got {_show(value)}"))
        return None
    check.unknown(value, path, _RELAXED)
    d = RelaxedAcceptanceSpec()
    return RelaxedAcceptanceSpec(
        top_k=check.get(value, f"{path}.top_k", _integer(1), d.top_k),
        delta=check.get(value, f"{path}.delta", _in_range(_number, lambda x: 0 <= x <= 1, "must be >= 0 and <= 1"),
                        d.delta),
    )


def _positive_list(value: object) -> list[int]:
    if not isinstance(value, list) or not value:
        raise _Bad(f"expected a non-empty list of integers >= 1, got {_show(value)}")
    return [_integer(1, MAX_NUM_SPECULATIVE_TOKENS)(v) for v in value]


def _string_list(value: object) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _Bad(f"expected a list of file paths, got {_show(value)}")
    return list(value)


def _train_spec(check: _Checker, data: Mapping[str, Any], method: str, draft_model: str | None) -> TrainSpec | None:
    if data.get("train") is None:
        return None
    t = check.section(data, "train", _TRAIN)
    if t is None:
        return None
    positive = _integer(1)
    fraction = _in_range(_number, lambda x: 0 <= x <= 1, "must be >= 0 and <= 1")
    above_zero = _in_range(_number, lambda x: x > 0, "must be > 0")
    d = TrainSpec()
    spec = TrainSpec(
        prompts=check.get(t, "train.prompts", positive, d.prompts),
        skip_prompts=check.get(t, "train.skip_prompts", _integer(0), d.skip_prompts),
        later_turns=check.get(t, "train.later_turns", _integer(0), d.later_turns),
        skip_later_turns=check.get(t, "train.skip_later_turns", _integer(0), d.skip_later_turns),
        init_from=check.get(t, "train.init_from", _optional(_string), d.init_from),
        answer_tokens=check.get(t, "train.answer_tokens", positive, d.answer_tokens),
        max_prompt_chars=check.get(t, "train.max_prompt_chars", _integer(16), d.max_prompt_chars),
        generation_batch_size=check.get(t, "train.generation_batch_size", positive, d.generation_batch_size),
        generation_dtype=check.get(t, "train.generation_dtype", _choice(DTYPES), d.generation_dtype),
        feature_cache=check.get(t, "train.feature_cache", _boolean, d.feature_cache),
        dataset_answers=check.get(t, "train.dataset_answers",
                                  _in_range(_number, lambda x: 0 <= x < float("inf"), "must be >= 0 and finite"),
                                  d.dataset_answers),
        dtype=check.get(t, "train.dtype", _choice(DTYPES), d.dtype),
        heldout_prompts=check.get(t, "train.heldout_prompts", positive, d.heldout_prompts),
        epochs=check.get(t, "train.epochs", above_zero, d.epochs),
        batch_size=check.get(t, "train.batch_size", positive, d.batch_size),
        max_seq_len=check.get(t, "train.max_seq_len", _integer(16), d.max_seq_len),
        learning_rate=check.get(t, "train.learning_rate", above_zero, d.learning_rate),
        min_lr_ratio=check.get(t, "train.min_lr_ratio", fraction, d.min_lr_ratio),
        warmup_steps=check.get(t, "train.warmup_steps", _integer(0), d.warmup_steps),
        weight_decay=check.get(t, "train.weight_decay", _in_range(_number, lambda x: x >= 0, "must be >= 0"),
                               d.weight_decay),
        grad_clip=check.get(t, "train.grad_clip", above_zero, d.grad_clip),
        ttt_steps=check.get(t, "train.ttt_steps", _integer(1, MAX_NUM_SPECULATIVE_TOKENS), d.ttt_steps),
        ttt_decay=check.get(t, "train.ttt_decay", _in_range(_number, lambda x: 0 < x <= 1, "must be > 0 and <= 1"),
                            d.ttt_decay),
        draft_vocab_size=check.get(t, "train.draft_vocab_size", _integer(2), d.draft_vocab_size),
        soft_labels=check.get(t, "train.soft_labels", fraction, d.soft_labels),
        head_init=check.get(t, "train.head_init", _choice(("random", "target")), d.head_init),
        keep_vocabulary=check.get(t, "train.keep_vocabulary", _boolean, d.keep_vocabulary),
        layers=check.get(t, "train.layers", positive, d.layers),
        block_size=check.get(t, "train.block_size", _integer(2, MAX_NUM_SPECULATIVE_TOKENS + 1), d.block_size),
        anchors=check.get(t, "train.anchors", positive, d.anchors),
        loss_gamma=check.get(t, "train.loss_gamma", _optional(above_zero), d.loss_gamma),
        mask_token_id=check.get(t, "train.mask_token_id", _optional(_integer(0)), d.mask_token_id),
        feature_layers=check.get(t, "train.feature_layers", _optional(positive), d.feature_layers),
        checkpoint_every=check.get(t, "train.checkpoint_every", positive, d.checkpoint_every),
        eval_every=check.get(t, "train.eval_every", positive, d.eval_every),
        eval_prompts=check.get(t, "train.eval_prompts", positive, d.eval_prompts),
        eval_ks=check.get(t, "train.eval_ks", _positive_list, d.eval_ks),
        eval_max_tokens=check.get(t, "train.eval_max_tokens", positive, d.eval_max_tokens),
        eval_prompt_sets=check.get(t, "train.eval_prompt_sets", _string_list, d.eval_prompt_sets),
        export_dtype=check.get(t, "train.export_dtype", _choice(DTYPES[1:]), d.export_dtype),
        seed=check.get(t, "train.seed", _integer(0), d.seed),
    )
    if method == "none":
        # The same recipe runs without its draft (`--set draft.method=none`, bench's ar baseline):
        # nothing to train then, so the section is set aside, checked but not tied to a method.
        return None
    method = method_parts(method)[0]
    if method is None:
        # `--set draft.method=suffix` on a draft's recipe: nothing to train, set aside as for none
        return None
    for key, methods in TRAIN_FIELDS_OF.items():
        if key in t and method not in methods:
            check.problems.append((f"train.{key}", f"applies to draft.method {' / '.join(methods)} only, "
                                                   f"not {method}"))
    if spec.keep_vocabulary and spec.init_from is None:
        check.problems.append(("train.keep_vocabulary", "keeps the vocabulary of train.init_from's draft, "
                                                        "and train.init_from is not set"))
    if draft_model is None:
        check.problems.append(("draft.model", "required with a train section: the trained draft is written there"))
    return spec
