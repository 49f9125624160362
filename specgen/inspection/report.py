"""`inspect_checkpoint`: what a checkpoint is, whether specgen can run it, what it will cost, and
whether a draft fits a target, from `config.json`, the safetensors headers and GGUF metadata.

Contract: `inspect_checkpoint(given, target=None, batch_size=, max_seq_len=)` returns an `Inspection`
or raises `Unreadable` (input that cannot be read: exit 2). Nothing is loaded: the checks are the
loaders' own, run dry on the headers (checkpoints/loading.py `dry=True`, which builds the modules
on the meta device), so inspect and `specgen run` can never disagree about a layout. The one
exception is an EAGLE-3 draft's `d2t` (a few hundred KB), read to check its range when `--target`
is given. `Inspection.runnable` is False when any problem or failed compatibility check was found
(exit 1); the figures are those of a bf16 run (GPU; a CPU run holds float32 weights, twice as much),
beside the weights as kept where a checkpoint publishes them quantized (block FP8; packed INT4 experts),
and `memory["gpus"]`: for an 80 GB and a 141 GB GPU, whether one rank's weights as kept and the asked
cache fit, and how many tokens of KV cache the rest holds (`gpu_fits`).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specgen.checkpoints.headers import DTYPE_NAMES, TensorHeader, checkpoint_headers, without_gc
from specgen.checkpoints.loading import (
    draft_tensor_names,
    kept_fp8_elements,
    kept_int4_parts,
    load_draft,
    load_target,
    target_config,
)
from specgen.models.tensor_parallel import TensorParallel, rank_shape
from specgen.checkpoints.quantized import INT4_PACKED, quantization_of
from specgen.checkpoints.store import CheckpointError, converted_folder, read_config, weight_files
from specgen.checkpoints.tokenizer import TOKENIZER_FILES
from specgen.drafts.base import TargetFit
from specgen.inspection.identify import Located, Unreadable, draft_method_of, locate
from specgen.models.materialise import LayoutError
from specgen.registry import DRAFT_METHODS, TARGET_ARCHITECTURES, UnsupportedError, architecture_name, check_pairing

RUN_DTYPE = torch.bfloat16


@dataclass(slots=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(slots=True)
class Inspection:
    path: str
    format: str                         # "safetensors" | "gguf"
    role: str                           # "target" | "draft" | "unsupported"
    architecture: str
    method: str | None = None           # the draft method (eagle3, dflash), or mtp inside a target
    fields: dict = field(default_factory=dict)
    layout: dict = field(default_factory=dict)
    tensors_by_dtype: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    compatibility: list[Check] | None = None    # with --target
    target: str | None = None
    seconds: float = 0.0

    @property
    def runnable(self) -> bool:
        return not self.problems and all(c.ok for c in self.compatibility or [])

    def to_dict(self) -> dict:
        out = asdict(self)
        out["runnable"] = self.runnable
        return out


def inspect_checkpoint(given: str, target: str | None = None, *, batch_size: int = 1,
                       max_seq_len: int = 4096, tensor_parallel: int = 1,
                       expert_parallel: bool = False) -> Inspection:
    """`tensor_parallel` N > 1: the memory figures of one of N ranks that split the target
    (models/tensor_parallel.py; `expert_parallel`: whole routed experts per rank), beside the whole."""
    with without_gc():
        return _inspect(given, target, batch_size, max_seq_len,
                        TensorParallel(0, tensor_parallel, None, expert_parallel))


def _inspect(given: str, target: str | None, batch_size: int, max_seq_len: int, tp: TensorParallel) -> Inspection:
    started = time.perf_counter()
    located = locate(given)
    converted = converted_folder(given, located.gguf) if located.gguf is not None else None
    if converted is not None and (converted / "config.json").is_file() and weight_files(converted):
        # a GGUF file runs from its conversion: inspect that (headers, not GGUF metadata: faster)
        report = _inspect_folder(Located(given, converted, None), target, batch_size, max_seq_len, tp)
        report.layout["converted from"] = str(located.gguf)
    elif located.gguf is not None:
        if target is not None:
            raise Unreadable(f"{given}: a GGUF file is not a draft (--target applies to drafts)")
        report = _inspect_gguf(located, batch_size, max_seq_len, tp)
    else:
        report = _inspect_folder(located, target, batch_size, max_seq_len, tp)
    report.seconds = time.perf_counter() - started
    return report


# ------------------------------------------------------------------------------------ safetensors


@dataclass(slots=True)
class _Target:
    """A target checkpoint read dry: its config object and its module on the meta device."""
    config: dict
    cfg: object
    model: torch.nn.Module | None
    folder: Path


def _inspect_folder(located: Located, target: str | None, batch_size: int, max_seq_len: int,
                    tp: TensorParallel) -> Inspection:
    folder = located.folder
    config = _config(folder)
    headers = _headers(folder)
    method = draft_method_of(config) or ("mtp" if _mtp_layer_alone(config, headers) else None)
    report = Inspection(str(folder), "safetensors", "draft" if method else "target",
                        architecture_name(config), method=method)
    report.layout = _layout(folder, headers, config)
    report.tensors_by_dtype = _by_dtype(headers)
    if method is None:
        if target is not None:
            report.problems.append(f"--target {target}: {folder} is itself a target, not a draft")
        _inspect_target(report, config, folder, headers, batch_size, max_seq_len, tp)
    else:
        _inspect_draft(report, config, folder, target, batch_size, max_seq_len)
    return report


def _mtp_layer_alone(config: dict, headers: dict[str, TensorHeader]) -> bool:
    """A folder that holds an MTP layer and nothing of a target (`train-draft`'s export: the
    target's config, tensors under `model.layers.{N}.*` only) is an MTP draft."""
    if not config.get("num_nextn_predict_layers") or "num_hidden_layers" not in config:
        return False
    prefix = DRAFT_METHODS["mtp"].builder().weight_prefix(config)
    return all(name.startswith(prefix) for name in headers)


def _config(folder: Path) -> dict:
    try:
        return read_config(folder)
    except CheckpointError as err:
        raise Unreadable(str(err)) from None


def _headers(folder: Path) -> dict[str, TensorHeader]:
    try:
        headers = checkpoint_headers(folder)
    except CheckpointError as err:
        raise Unreadable(str(err)) from None
    if not headers:
        raise Unreadable(f"{folder}: no *.safetensors weights in this folder")
    return headers


def _inspect_target(report: Inspection, config: dict, folder: Path, headers: dict, batch_size: int,
                    max_seq_len: int, tp: TensorParallel) -> None:
    if report.architecture not in TARGET_ARCHITECTURES:
        report.role = "unsupported"
        report.problems.append(f"architecture {report.architecture} is not supported "
                               f"(targets: {', '.join(TARGET_ARCHITECTURES)}; drafts: eagle3, dflash)")
        return
    target = _dry_target(report.problems, config, folder)
    if target is None:
        return
    report.fields = _target_fields(target.cfg)
    pairs_with_mtp = "mtp" in TARGET_ARCHITECTURES[report.architecture].draft_methods
    prefix = DRAFT_METHODS["mtp"].builder().weight_prefix(config) if pairs_with_mtp else None
    if prefix is not None and any(n.startswith(prefix) for n in headers):
        report.method = "mtp"
        report.fields["mtp layer"] = prefix + "*"
        if target.model is not None:
            _dry_draft(report.problems, "mtp", config, folder, target, label="MTP layer: ")
    report.memory = _target_memory(target.cfg, batch_size, max_seq_len, tp, report.problems)
    memory = report.memory
    fp8, scales = kept_fp8_elements(config, folder)
    if fp8:   # on GPUs with FP8 tensor cores the block-FP8 weights stay FP8 (target.fp8_weights)
        saved = fp8 * (RUN_DTYPE.itemsize - 1) - scales * 4
        memory["fp8_weights_bytes"] = memory["weights_bytes"] - saved
        if "per_rank" in memory:      # split over ranks like the rest (job/memory.py does the same)
            memory["per_rank"]["fp8_weights_bytes"] = memory["per_rank"]["weights_bytes"] - saved // tp.size
    int4, words, int4_scales = kept_int4_parts(config, folder)
    if int4:  # packed INT4 experts stay packed (target.quantization: auto), split evenly like the experts
        saved = int4 * RUN_DTYPE.itemsize - words - int4_scales
        memory["int4_weights_bytes"] = memory["weights_bytes"] - saved
        if "per_rank" in memory:
            memory["per_rank"]["int4_weights_bytes"] = memory["per_rank"]["weights_bytes"] - saved // tp.size
    held = memory.get("per_rank", memory)
    weights = held.get("int4_weights_bytes", held.get("fp8_weights_bytes", held["weights_bytes"]))
    memory["gpus"] = gpu_fits(weights, held["kv_cache_bytes_per_token"], batch_size * max_seq_len)


# GPU memory as torch finds it free on an idle card of each size (what `specgen run` checks against)
GPUS = (("80 GB (H100, A100)", 78 << 30), ("141 GB (H200)", 139 << 30))
# Beside weights and cache: the CUDA context, the step's and a prefill's workspace (job/memory.py
# estimates them per recipe; at batch 64 they stay under this for every target specgen runs)
GPU_RESERVE = 4 << 30


def gpu_fits(weights: int, kv_per_token: int, tokens: int) -> list[dict]:
    """Per GPU size: whether `weights` (one rank's) and `tokens` of KV cache fit in `specgen run`'s
    margin of it (job/memory.MEMORY_MARGIN) beside GPU_RESERVE, and how many tokens of KV cache the
    rest holds."""
    from specgen.job.memory import MEMORY_MARGIN

    fits = []
    for name, size in GPUS:
        room = int(MEMORY_MARGIN * size) - GPU_RESERVE - weights
        kv_tokens = max(0, room // kv_per_token) if kv_per_token else 0
        fits.append({"gpu": name, "bytes": size, "weights_fit": room > 0, "fits": kv_tokens >= tokens,
                     "kv_cache_tokens": kv_tokens})
    return fits


def _dry_target(problems: list[str], config: dict, folder: Path) -> _Target | None:
    try:
        cfg = target_config(config, str(folder / "config.json"))
    except CheckpointError as err:
        problems.append(str(err))
        return None
    try:
        model = load_target(config, folder, dtype=RUN_DTYPE, device="meta", dummy=False, dry=True)
    except LayoutError as err:
        problems.extend(err.problems)
        model = None
    except CheckpointError as err:
        problems.append(str(err))
        model = None
    return _Target(config, cfg, model, folder)


def _dry_draft(problems: list[str], method: str, config: dict, folder: Path, target: _Target,
               label: str = "") -> bool:
    try:
        load_draft(method, config, folder, target.model, num_speculative_tokens=None if method == "dflash" else 1,
                   dtype=RUN_DTYPE, device="meta", dummy=False, dry=True)
    except LayoutError as err:
        problems.extend(label + p for p in err.problems)
        return False
    except (CheckpointError, ValueError) as err:
        problems.append(label + str(err))
        return False
    return True


def _target_fields(cfg) -> dict:
    fields = {"layers": cfg.num_layers, "hidden size": cfg.hidden_size, "vocabulary": cfg.vocab_size}
    mla, moe = getattr(cfg, "mla", None), getattr(cfg, "moe", None)
    if mla is None:
        fields.update({"attention heads": cfg.num_heads, "KV heads": cfg.num_kv_heads, "head dim": cfg.head_dim,
                       "intermediate size": cfg.intermediate_size})
        rope = cfg.rope
    else:
        fields.update({"attention heads": mla.num_heads, "attention": "MLA", "q_lora_rank": mla.q_lora_rank,
                       "kv_lora_rank": mla.kv_lora_rank, "qk_rope_head_dim": mla.qk_rope_head_dim,
                       "qk_nope_head_dim": mla.qk_nope_head_dim, "v_head_dim": mla.v_head_dim})
        rope = mla.rope
    if moe is not None:
        fields.update({"dense layers": cfg.first_k_dense_replace, "routed experts": moe.n_routed_experts,
                       "experts per token": moe.num_experts_per_tok, "shared experts": moe.n_shared_experts,
                       "expert groups": f"{moe.topk_group} of {moe.n_group}"})
    fields["rope"] = rope.rope_type + (f" (factor {rope.params['factor']})" if "factor" in rope.params else "")
    fields["rope theta"] = rope.theta
    return fields


def _target_memory(cfg, batch_size: int, max_seq_len: int, tp: TensorParallel, problems: list[str]) -> dict:
    """Weights and cache in bf16; with tensor parallelism, one rank's share too (`per_rank`), or a
    problem saying why the target does not split that way."""
    per_token = cfg.cache_bytes_per_token(RUN_DTYPE)
    memory = {"dtype": "bfloat16", "weights_bytes": cfg.num_parameters() * RUN_DTYPE.itemsize,
              "kv_cache_bytes_per_token": per_token, "batch_size": batch_size, "max_seq_len": max_seq_len,
              "kv_cache_bytes": per_token * batch_size * max_seq_len}
    full = getattr(cfg, "full_kv_bytes_per_token", None)
    if full is not None:
        memory["full_kv_bytes_per_token"] = full(RUN_DTYPE)   # what uncompressed K/V would take
    if tp.active:
        try:
            rank = rank_shape(cfg, tp)
        except ValueError as err:
            problems.append(str(err))
            return memory
        rank_token = rank.cache_bytes_per_token(RUN_DTYPE)
        memory["per_rank"] = {"tensor_parallel_size": tp.size, "expert_parallel": tp.expert_parallel,
                              "weights_bytes": rank.num_parameters() * RUN_DTYPE.itemsize,
                              "kv_cache_bytes_per_token": rank_token,
                              "kv_cache_bytes": rank_token * batch_size * max_seq_len}
    return memory


# ----------------------------------------------------------------------------------------- drafts


def _inspect_draft(report: Inspection, config: dict, folder: Path, target: str | None, batch_size: int,
                   max_seq_len: int) -> None:
    method = report.method
    builder = DRAFT_METHODS[method].builder()
    if target is None:
        dims = _standin_dims(method, config, checkpoint_headers(folder))
        fit_checks = None
    else:
        report.target = target
        t = _target_for(target)
        report.compatibility = [_pairing_check(t, method)]
        if t.model is None:
            report.compatibility.append(Check("target", False, f"{target} cannot be run (inspect it alone)"))
            return
        dims = (t.cfg.num_layers, t.cfg.hidden_size, t.cfg.vocab_size)
    fit = TargetFit()
    try:
        dcfg = builder.config_cls.from_hf(config, target_layers=dims[0], target_hidden=dims[1],
                                          target_vocab=dims[2], fit=fit)
    except (KeyError, TypeError, ValueError) as err:
        report.problems.append(f"{folder}/config.json: not a usable {method} config: {err!r}")
        return
    report.fields = _draft_fields(dcfg)
    names = draft_tensor_names(method, folder, config)
    report.memory = {"dtype": "bfloat16", "weights_bytes": dcfg.num_parameters(names) * RUN_DTYPE.itemsize,
                     "kv_cache_bytes_per_token": dcfg.cache_bytes_per_token(RUN_DTYPE),
                     "batch_size": batch_size, "max_seq_len": max_seq_len,
                     "kv_cache_bytes": dcfg.cache_bytes_per_token(RUN_DTYPE) * batch_size * max_seq_len}
    if target is None:
        # no target: the layout is checked against a stand-in of the dimensions the draft states
        _dry_draft(report.problems, method, config, folder, _standin_target(dims, config))
        return
    fit_checks = [Check(c.name, c.ok, c.detail) for c in fit.checks]
    report.compatibility += fit_checks
    if dcfg.draft_vocab_size != dcfg.vocab_size and all(c.ok for c in fit_checks):
        report.compatibility.append(_d2t_check(folder, dcfg, builder.weight_prefix(config) + "d2t"))
    report.compatibility.append(_tokenizer_check(folder, t.folder))
    if all(c.ok for c in report.compatibility):
        weights: list[str] = []
        ok = _dry_draft(weights, method, config, folder, t)
        report.compatibility.append(Check("weights", ok, "every tensor the draft needs, in the shapes its config "
                                          "and the target imply" if ok else "; ".join(weights[:4])))


def _standin_dims(method: str, config: dict, headers: dict[str, TensorHeader]) -> tuple[int, int, int]:
    """The target dimensions (layers, hidden, vocab) a draft implies, for checking its layout when no
    --target is given: read where the draft's own config class reads them."""
    from specgen.drafts.dflash import dflash_value

    hidden = int(config.get("target_hidden_size") or config.get("hidden_size") or 0)
    head = headers.get("lm_head.weight")
    vocab = int(config.get("vocab_size") or config.get("draft_vocab_size") or (head.shape[0] if head else 0))
    ids = (dflash_value(config, "target_layer_ids") if method == "dflash" else
           (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
           or config.get("eagle_aux_hidden_state_layer_ids")) or []
    layers = int(config.get("num_target_layers") or (max(ids) + 1 if ids else 32))
    if method == "mtp":          # an MTP draft's config is its target's
        layers = int(config["num_hidden_layers"])
    return layers, hidden, vocab


def _standin_target(dims: tuple[int, int, int], config: dict) -> _Target:
    """A Llama target on the meta device with the draft's stated dimensions (no --target given)."""
    from specgen.models.llama import LlamaConfig, LlamaForCausalLM

    layers, hidden, vocab = dims
    heads = int(config.get("num_attention_heads") or 1)
    cfg = LlamaConfig.from_hf({"hidden_size": hidden, "intermediate_size": int(config.get("intermediate_size") or hidden),
                               "num_hidden_layers": layers, "num_attention_heads": heads,
                               "num_key_value_heads": int(config.get("num_key_value_heads") or heads),
                               "head_dim": int(config.get("head_dim") or hidden // heads), "vocab_size": vocab})
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return _Target({}, cfg, model, Path("."))


def _target_for(given: str) -> _Target:
    located = locate(given)
    folder = located.folder
    if folder is None:
        folder = converted_folder(given, located.gguf)
        if not ((folder / "config.json").is_file() and weight_files(folder)):
            raise Unreadable(f"--target {given}: a GGUF target is converted on its first `specgen run`; "
                             "run it once, then inspect the draft against it")
    config = _config(folder)
    _headers(folder)
    located = Located(given, folder, None)
    problems: list[str] = []
    if architecture_name(config) not in TARGET_ARCHITECTURES or draft_method_of(config):
        return _Target(config, None, None, located.folder)
    target = _dry_target(problems, config, located.folder)
    if target is None or problems:
        return _Target(config, target.cfg if target else None, None, located.folder)
    return target


def _pairing_check(target: _Target, method: str) -> Check:
    name = architecture_name(target.config)
    try:
        check_pairing(name, method)
    except UnsupportedError as err:
        return Check("pairing", False, str(err))
    return Check("pairing", True, f"{method} drafts for {name}")


def _d2t_check(folder: Path, dcfg, key: str) -> Check:
    from specgen.checkpoints.weights import read_tensors
    from specgen.drafts.vocab import draft_to_target

    try:
        d2t = read_tensors(weight_files(folder), prefix=key).get(key)
        if d2t is None:
            return Check("d2t range", False, "draft_vocab_size is reduced but the checkpoint has no d2t")
        mapping = draft_to_target(d2t, dcfg.draft_vocab_size, dcfg.vocab_size, str(folder))
    except CheckpointError as err:
        return Check("d2t range", False, str(err))
    return Check("d2t range", True, f"{dcfg.draft_vocab_size} draft ids map into target ids "
                                    f"{int(mapping.min())}..{int(mapping.max())}")


def _tokenizer_check(draft: Path, target: Path) -> Check:
    from specgen.checkpoints.tokenizer import has_tokenizer, load_tokenizer

    if not has_tokenizer(draft):
        return Check("tokenizer", True, "the draft ships no tokenizer of its own: it uses the target's")
    if not has_tokenizer(target):
        return Check("tokenizer", True, "only the draft ships a tokenizer: nothing to compare (a run uses the target's)")
    try:
        mine, theirs = load_tokenizer(draft, 0).get_vocab(), load_tokenizer(target, 0).get_vocab()
    except Exception as err:  # noqa: BLE001 - a tokenizer transformers cannot read is a FAIL, not a crash
        return Check("tokenizer", False, f"cannot compare the tokenizers: {err}")
    if mine == theirs:
        return Check("tokenizer", True, f"the same {len(mine)} tokens")
    differ = sum(1 for k, v in mine.items() if theirs.get(k) != v) + len(theirs.keys() - mine.keys())
    return Check("tokenizer", False, f"the draft's tokenizer differs from the target's in {differ} tokens")


def _draft_fields(dcfg) -> dict:
    fields = {"hidden size": dcfg.hidden_size}
    for attr, label in (("num_layers", "layers"), ("vocab_size", "vocabulary"), ("draft_vocab_size", "draft vocabulary"),
                        ("block_size", "block size"), ("mask_token_id", "mask token"),
                        ("aux_layer_ids", "aux layer ids"), ("target_layer_ids", "target layer ids"),
                        ("target_hidden_size", "target hidden size")):
        value = getattr(dcfg, attr, None)
        if value is not None:
            fields[label] = list(value) if isinstance(value, tuple) else value
    if getattr(dcfg, "mla", None) is not None:
        fields["attention"] = f"MLA (kv_lora_rank {dcfg.mla.kv_lora_rank})"
    return fields


# ------------------------------------------------------------------------------------------ shared


def _layout(folder: Path, headers: dict[str, TensorHeader], config: dict) -> dict:
    index = (folder / "model.safetensors.index.json").is_file()
    files = sum(1 for _ in folder.glob("*.safetensors"))
    groups: dict[str, int] = {}
    for name in headers:
        key = _group(name)
        groups[key] = groups.get(key, 0) + 1
    try:
        quant = quantization_of(config, str(folder / "config.json"))
        described = None
        if quant is not None and quant.fp8_block:
            described = f"block FP8 e4m3 {quant.fp8_block[0]}x{quant.fp8_block[1]}"
        elif quant is not None:
            described = f"INT4 pack-quantized, groups of {quant.int4_group}"
    except CheckpointError as err:
        described = str(err)
    tokenizer = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    return {"files": files, "index": index, "tensors": len(headers), "groups": groups, "quantization": described,
            "tokenizer": ", ".join(tokenizer) or "none (a run without one uses a byte-level stand-in)"}


WRAPPERS = ("model", "language_model")     # name parts that hold the interesting one


def _group(name: str) -> str:
    """A tensor name's group: `model.layers.*`, `language_model.model.layers.*`, `fc`, `midlayer`..."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 1]) + ".*"
        if part not in WRAPPERS:
            return ".".join(parts[: i + 1])
    return name


def _by_dtype(headers: dict[str, TensorHeader]) -> dict:
    out: dict[str, list[int]] = {}
    for name, h in headers.items():
        label = DTYPE_NAMES.get(h.dtype, str(h.dtype))
        params = math.prod(h.shape)
        size = params * h.dtype.itemsize
        if label == "I32" and name.endswith(INT4_PACKED):       # eight 4-bit values per int32
            label, params = "INT4 (packed in I32)", params * 8
        row = out.setdefault(label, [0, 0, 0])
        row[0] += 1
        row[1] += params
        row[2] += size
    ordered = sorted(out.items(), key=lambda kv: -kv[1][2])
    return {k: {"tensors": t, "parameters": n, "bytes": b} for k, (t, n, b) in ordered}


# ------------------------------------------------------------------------------------------- GGUF


def _inspect_gguf(located: Located, batch_size: int, max_seq_len: int, tp: TensorParallel) -> Inspection:
    """GGUF metadata (no tensor data): the config transformers derives from it, and the tensor types.
    Slower than a folder (a few seconds: the metadata holds the whole vocabulary, read twice); once
    `specgen run` has converted the file, its conversion is inspected instead."""
    path = located.gguf
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
    except (OSError, ValueError) as err:
        raise Unreadable(f"{path}: not a readable GGUF file: {err}") from None
    by_type: dict[str, dict] = {}
    for t in reader.tensors:
        row = by_type.setdefault(t.tensor_type.name, {"tensors": 0, "parameters": 0, "bytes": 0})
        row["tensors"] += 1
        row["parameters"] += int(t.n_elements)
        row["bytes"] += int(t.n_bytes)
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "unknown"
    report = Inspection(str(path), "gguf", "target", arch)
    report.tensors_by_dtype = dict(sorted(by_type.items(), key=lambda kv: -kv[1]["bytes"]))
    report.layout = {"files": 1, "index": False, "tensors": len(reader.tensors), "groups": {},
                     "quantization": ", ".join(by_type), "note": "converted once to safetensors on first run"}
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
        config["architectures"] = config.get("architectures") or [f"{arch.capitalize()}ForCausalLM"]
        cfg = target_config(config, str(path))
    except (CheckpointError, OSError, ValueError, KeyError) as err:
        report.role = "unsupported"
        report.problems.append(f"{path}: GGUF architecture {arch}: {err}")
        return report
    report.architecture = architecture_name(config)
    report.fields = _target_fields(cfg)
    report.memory = _target_memory(cfg, batch_size, max_seq_len, tp, report.problems)
    return report
