"""(target architecture, draft method) -> how to build the draft for the unified step. One table.

Every pairing runs the same `UnifiedStep`; what differs is the draft module plugged into it. A pairing
missing here is refused before any weights load.
"""

from __future__ import annotations

from specgen.drafts.dflash import DFlashConfig, dummy_dflash_config, load_dflash_draft
from specgen.drafts.eagle3 import Eagle3Config, dummy_eagle3_config, load_eagle3_draft
from specgen.drafts.mtp import MtpConfig, dummy_mtp_config, load_mtp_draft

# draft method -> (loader, config for random-init drafts, config class with `num_parameters`)
DRAFT_KINDS = {
    "eagle3": (load_eagle3_draft, dummy_eagle3_config, Eagle3Config),
    "dflash": (load_dflash_draft, dummy_dflash_config, DFlashConfig),
    "mtp": (load_mtp_draft, dummy_mtp_config, MtpConfig),
}

# target architecture -> draft methods it supports ("none" = plain decoding, always)
PAIRINGS: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": ("none", "eagle3", "dflash", "mtp"),
}


def check_pairing(architecture: str, method: str) -> None:
    methods = PAIRINGS.get(architecture, ("none",))
    if method not in methods:
        raise ValueError(f"draft.method {method!r} is not available for {architecture} targets "
                         f"(available: {', '.join(methods)})")


def draft_kind(method: str):
    return DRAFT_KINDS[method]
