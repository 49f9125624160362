"""The one table of what specgen runs: target architectures and draft methods, and which pair.

Contract: this module is declarative and imports nothing heavy (no torch), so the recipe schema can
read it before any model code loads. Each entry names the module that implements it; `builder()`
imports that module on first use and returns its builder object:
- a target module defines `ARCHITECTURE` (a `models.protocol.TargetBuilder`: config class, model
  class, weight adapter);
- a draft module defines `METHOD` (a `drafts.base.DraftBuilder`: config class, build function,
  dummy config, where its tensors sit in a checkpoint).
Readers: `recipe.py` (method names, which methods pick K themselves, which may live inside the
target), `models/loading.py` and `checkpoints/` (builders), `job/` (pairings, dummy configs).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DraftMethod:
    name: str
    module: str
    k_from_draft: bool = False       # the draft's config decides the default K (DFlash: block_size - 1)
    lives_in_target: bool = False    # its layer may sit inside the target checkpoint (MTP)
    on_host: bool = False            # proposes on the host from text seen, no model (suffix)

    def builder(self):
        assert not self.on_host, f"{self.name} has no model to build"
        return importlib.import_module(self.module).METHOD


@dataclass(frozen=True, slots=True)
class TargetArchitecture:
    name: str                        # HF `architectures[0]`
    module: str
    model_types: tuple[str, ...]     # HF `model_type` values that mean this architecture
    draft_methods: tuple[str, ...]   # "none" (plain decoding) is always available

    def builder(self):
        return importlib.import_module(self.module).ARCHITECTURE


DRAFT_METHODS: dict[str, DraftMethod] = {m.name: m for m in (
    DraftMethod("eagle3", "specgen.drafts.eagle3"),
    DraftMethod("dflash", "specgen.drafts.dflash", k_from_draft=True),
    DraftMethod("mtp", "specgen.drafts.mtp", lives_in_target=True),
    # any target: it needs no checkpoint, only the tokens
    DraftMethod("suffix", "specgen.drafts.suffix", on_host=True),
)}

TARGET_ARCHITECTURES: dict[str, TargetArchitecture] = {a.name: a for a in (
    TargetArchitecture("LlamaForCausalLM", "specgen.models.llama", ("llama",), ("eagle3", "dflash", "mtp", "suffix")),
    TargetArchitecture("DeepseekV3ForCausalLM", "specgen.models.deepseek_v3", ("deepseek_v3",),
                       ("mtp", "eagle3", "dflash", "suffix")),
    # Kimi K2 / K2.5 ship no MTP layer (num_nextn_predict_layers: 0): EAGLE-3 and DFlash drafts only
    TargetArchitecture("KimiK25ForConditionalGeneration", "specgen.models.kimi_k25", ("kimi_k25",),
                       ("eagle3", "dflash", "suffix")),
)}

# A draft model and host proposals side by side (`eagle3+suffix`): per step and slot, the better one.
HYBRID_METHODS: tuple[str, ...] = tuple(f"{model.name}+{host.name}" for model in DRAFT_METHODS.values()
                                        if not model.on_host for host in DRAFT_METHODS.values() if host.on_host)

# Every value `draft.method` may take.
METHOD_NAMES: tuple[str, ...] = ("none", *DRAFT_METHODS, *HYBRID_METHODS)


def method_parts(method: str) -> tuple[str | None, str | None]:
    """(the draft model's method, the host method) a `draft.method` names; None for an absent part."""
    parts = method.split("+") if method != "none" else []
    model = next((p for p in parts if p in DRAFT_METHODS and not DRAFT_METHODS[p].on_host), None)
    host = next((p for p in parts if p in DRAFT_METHODS and DRAFT_METHODS[p].on_host), None)
    return model, host


class UnsupportedError(ValueError):
    """An architecture or pairing specgen does not run; the message lists what it does run."""


def architecture_name(config: dict) -> str:
    """The architecture an HF config names (by `architectures`, else by `model_type`)."""
    names = config.get("architectures") or []
    known = next((n for n in names if n in TARGET_ARCHITECTURES), None)
    if known is not None:
        return known
    if not names:
        model_type = config.get("model_type")
        for arch in TARGET_ARCHITECTURES.values():
            if model_type in arch.model_types:
                return arch.name
    return str(names[0] if names else config.get("model_type"))


def target_architecture(config: dict, where: str = "config.json") -> TargetArchitecture:
    name = architecture_name(config)
    if name not in TARGET_ARCHITECTURES:
        raise UnsupportedError(f"{where}: architecture {name} is not supported "
                               f"(supported: {', '.join(TARGET_ARCHITECTURES)})")
    return TARGET_ARCHITECTURES[name]


def check_pairing(architecture: str, method: str) -> None:
    arch = TARGET_ARCHITECTURES.get(architecture)
    single = arch.draft_methods if arch else ()
    hybrids = tuple(m for m in HYBRID_METHODS if all(p in single for p in method_parts(m)))
    methods = ("none", *single, *hybrids)
    if method not in methods:
        raise UnsupportedError(f"draft.method {method!r} is not available for {architecture} targets "
                               f"(available: {', '.join(methods)})")
