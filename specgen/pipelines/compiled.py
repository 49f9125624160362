"""How the runner calls the step and the prefill: eagerly, or compiled (torch.compile; CUDA graphs).

Contract: `StepFunctions(unified, state, caches, sampling, device=, compile=)` exposes `step(kv_len)`
and `prefill(batch)` bound to the runner's state, plus `key_index(kv_len)` and `warm_up()`, which
compiles (and on CUDA captures) every variant a run will need before the first request, so no
compilation ever happens mid-run; it returns the seconds that took.

Variants are few by construction:
- the step is compiled once (`fullgraph`, static shapes) with the attended key count as a DYNAMIC
  size (`key_index`, an arange whose length is the bound): one graph serves every length bucket.
  On CUDA the attention kernel reads per-row lengths, the bound is the allocation, and the step is
  one CUDA graph (Inductor's `triton.cudagraphs`, state and caches at static addresses);
- the prefill is compiled with dynamic shapes (rows and padded length), without CUDA graphs, where
  it pays (CUDA); on CPU its large GEMMs gain little from Inductor and it stays eager.
Inductor's on-disk caches live under the directory the caller gives (`$SPECGEN_CACHE/compiled`), so
a second run of the same recipe reuses compiled code (whole graphs when not frozen; the generated
kernels always: frozen graphs bypass Inductor's graph cache).
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from specgen.pipelines.unified import PrefillBatch, StepCaches, StepState, UnifiedStep
from specgen.sampling import SamplingTensors


CPU_FREEZE_MAX_ROWS = 64


def freezes(device: torch.device, rows: int) -> bool:
    """Whether a compiled step of `rows` tokens folds its weights in (see StepFunctions)."""
    return device.type == "cpu" and rows <= CPU_FREEZE_MAX_ROWS


def use_compile_cache(directory: Path) -> None:
    """Point Inductor's (and Triton's) on-disk caches at `directory` unless the user already chose."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(directory / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(directory / "triton"))


# Inductor's CPU autotuning calls a deprecated storage API: a warning no user can act on.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)

# Frozen CPU steps also take Inductor's C++ GEMM template (weights prepacked into its blocked
# layout, a micro-kernel per shape) where it wins its autotuning against oneDNN/MKL. A step's GEMMs
# have few rows (K + 1 per slot), a shape those libraries run far from the memory bound: on 2 cores,
# SmolLM2's fp32 GEMMs took 67 ms at 4 rows against 33 ms at 1 row (frozen, oneDNN), and 19 ms at
# both with the template. It needs frozen weights (constants to prepack). The autotuning report is
# kept off the user's terminal.
CPU_FROZEN_SETTINGS = {
    "max_autotune_gemm": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


def _under_settings(compiled, freezing: bool, device: torch.device):
    """Inductor reads `freezing` (and the GEMM settings) from its global config when it compiles,
    and it compiles at a call (the first, or a recompile), not at torch.compile():
    `options={"freezing": ...}` never reaches it (measured: no weight was folded or prepacked). So
    every call runs under the settings; the patch costs microseconds against a step of milliseconds."""
    settings = {"freezing": freezing}
    if freezing and device.type == "cpu":
        settings.update(CPU_FROZEN_SETTINGS)

    def call(*args):
        with inductor_config.patch(settings):
            return compiled(*args)
    return call


class StepFunctions:
    def __init__(self, unified: UnifiedStep, state: StepState, caches: StepCaches,
                 sampling: SamplingTensors, *, device: torch.device, compile: bool,
                 compile_prefill: bool | None = None) -> None:
        self.unified, self.state, self.caches, self.sampling = unified, state, caches, sampling
        self.device = device
        self.compiled = bool(compile)
        self.cuda_graphs = self.compiled and device.type == "cuda"
        self._key_index: dict[int, torch.Tensor] = {}
        self._rows = (state, caches, sampling)          # what the step runs over (see use_slots)
        self._step = unified.step
        self._prefill = unified.prefill
        self.prefill_compiled = False
        self.frozen = False
        if not self.compiled:
            return
        # Weights never change during a run: on CPU Inductor can fold them in as constants
        # ("freezing"), prepack them, and pick each GEMM's kernel (CPU_FROZEN_SETTINGS). Measured
        # on 2 CPU cores (SmolLM2, fp32, benchmarks/step_cost.py --compile, ms per step): batch 1,
        # frozen with oneDNN's prepacking only: 47 (plain, 1 row), 95 (EAGLE-3 K = 3, 4 rows);
        # frozen with the C++ template: 19-22 and 30. Batch 8, not frozen / frozen with the
        # template: 8 rows 76.8 / 48.5; 32 rows 181.8 / 163.5; 64 rows 288.7 / 272.2 (oneDNN's
        # prepacking alone had made 16 rows slower frozen). So freeze every CPU step up to the
        # sizes measured. Not on CUDA: nothing is prepacked there, and frozen graphs bypass
        # Inductor's on-disk graph cache.
        rows = state.pending.numel()
        self.frozen = freezes(device, rows)
        options = {}
        # Several runners in one process (tests, benchmarks, library users) share the step's code
        # object; each adds its own variants.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if self.cuda_graphs:
            # CUDA graphs (what mode="reduce-overhead" turns on) replay fixed addresses: everything
            # the step reads or writes in place is marked static.
            options["triton.cudagraphs"] = True
            for t in (*state.tensors(), *caches.tensors(), *unified.target.static_tensors(),
                      *sampling.tensors()):
                torch._dynamo.mark_static_address(t)
        self._step = _under_settings(
            torch.compile(unified.step, fullgraph=True, dynamic=False, options=options), self.frozen, device)
        self.prefill_compiled = compile_prefill if compile_prefill is not None else device.type == "cuda"
        if self.prefill_compiled:
            self._prefill = _under_settings(
                torch.compile(unified.prefill, fullgraph=True, dynamic=True), self.frozen, device)

    def key_index(self, kv_len: int) -> torch.Tensor:
        """The arange whose length bounds the keys the reference attention reads (one per bucket)."""
        index = self._key_index.get(kv_len)
        if index is None:
            index = self._key_index[kv_len] = torch.arange(kv_len, device=self.device)
            # dynamic: one compiled step for every bucket (the kernel path has one bound). CUDA graphs
            # still record one graph per bucket (without the kernel only), during the warm-up and
            # then at the first step of each longer bucket.
            if self.compiled and not self.unified.use_kernel:
                # below the cache length: a slice as long as the cache would be specialised away
                torch._dynamo.mark_dynamic(index, 0, min=2, max=self.caches.target.max_len - 1)
        return index

    def step(self, kv_len: int) -> torch.Tensor:
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        state, caches, sampling = self._rows
        return self._step(state, caches, sampling, self.key_index(kv_len))

    def use_slots(self, slots: int) -> None:
        """Steps run over the first `slots` slots only (eager steps: other shapes would recompile)."""
        assert not self.compiled, "a compiled step keeps its batch shape"
        self._rows = (self.state.narrow(slots), self.caches.narrow(slots),
                      self.sampling.select(slice(0, slots)))

    def prefill(self, batch: PrefillBatch) -> None:
        if self.prefill_compiled:
            for t in (batch.rows, batch.tokens, batch.positions, batch.next_tokens, batch.last_index,
                      batch.is_last, batch.noise_key, batch.limit, batch.reasoning):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            for t in (batch.tokens, batch.positions, batch.next_tokens):
                torch._dynamo.maybe_mark_dynamic(t, 1)
        self._prefill(self.state, self.caches, batch, self.sampling)

    def warm_up(self, kv_len: int, prefill_batches: list[PrefillBatch]) -> float:
        """Compile / capture everything before the run (all slots inactive: nothing advances)."""
        if not self.compiled:
            return 0.0
        start = time.perf_counter()
        for batch in prefill_batches:
            self.prefill(batch)
        self.state.active.zero_()
        # CUDA graphs: the first calls run eagerly, the next records; then replays.
        for _ in range(3 if self.cuda_graphs else 1):
            self.step(kv_len)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start
