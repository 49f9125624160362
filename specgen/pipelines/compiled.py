"""How the runner calls the steps (plain and speculative) and the prefill: eagerly, or compiled (torch.compile;
CUDA graphs).

Contract: `StepFunctions(unified, state, caches, sampling, device=, compile=)` exposes
`verify(kv_len, t)` (t = 1: the plain step), `step(kv_len, window, k)` (a speculative step: the
draft of k tokens, then the verify of k + 1 rows) and `prefill(batch)`, bound to the runner's state,
plus `warm_up(kv_len, prefill_batches, ks, plain, verifies)`, which compiles (and on CUDA captures)
the variants `ks` (with `plain` the plain step, and the verifies of t rows in `verifies`: a hybrid's
steps of host drafts alone) before the first request; it returns the seconds
that took. Everything else compiles on first use (`compiled_ks` and `verify_ready` say what exists;
`compile_seconds` what each cost), so a job pays only for the variants its policy actually runs.

Variants are few by construction:
- the plain step (T = 1 row per slot) is the graph `draft.method: none` runs, and variant k is one
  graph of its own: its draft (the chain unrolled, the window a dynamic size) and the verify of
  T = k + 1 rows, in one call. One call rather than two (the draft's graph, then the verify's):
  each call of a compiled function pays its guards, its wrappers and Inductor's settings (`call`
  below), which measured 0.64 ms of an EAGLE-3 k = 2 step (12.67 -> 12.03 ms against 10.74 for the
  plain step: SmolLM2, bf16, batch 1, 2 AMD EPYC Zen 4 cores, the same process).
  The verify's rows are static: one graph for every T (its rows a dynamic size) was tried: for T = 1
  it ran plain steps 1.6x slower than a plain job (57.8 ms a step against 35.4, 2 AMD EPYC cores);
  for T >= 3 Inductor's code ran well only near the size it was first compiled at (compiled at
  T = 5: T = 3 took 30.4 ms against 17.1 for T = 2); and T = 2 took a graph of its own anyway (a
  contiguity check on the T - 1 draft columns asks whether that size is 1). The attended key count
  is a dynamic size (`key_index`, an arange whose length is the bound): one graph serves every
  length bucket. On CUDA the attention kernel reads per-row lengths, the bound is the allocation,
  and each (variant, bucket, window) is one CUDA graph (Inductor's `triton.cudagraphs`, state and
  caches at static addresses);
- a structured step (`unified.structured`: response formats) is the exception: the draft's graph,
  then the host (`between`: the grammar's token masks, which depend on the drafts), then the
  verify's (measured: EAGLE-3 K = 3 on SmolLM2 under a JSON schema, batch 1, 2 AMD EPYC Zen 3
  cores, fp32: 40.1 ms a step against 37.9 unconstrained, the masks included);
- the prefill is compiled with dynamic shapes (rows and padded length), without CUDA graphs, where
  it pays (CUDA); on CPU its large GEMMs gain little from Inductor and it stays eager.
Inductor's on-disk caches live under the directory the caller gives (`$SPECGEN_CACHE/compiled`), so
a second run of the same recipe reuses compiled code: whole graphs (frozen ones keyed by their
weights' values: cpu_gemm.py), and the generated kernels. Its graph cache there keeps the most
recent entries up to `GRAPH_CACHE_MAX_BYTES` (`prune_graph_cache`, at each compiled run's start).
"""

from __future__ import annotations

import itertools
import os
import shutil
import time
import types
import warnings
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from specgen.kernels.cpu_bf16_products import float32_products
from specgen.machine import cpu_has_bf16
from specgen.models.products import row_invariant_products
from specgen.pipelines.compile_clock import CompileClock
from specgen.pipelines.cpu_gemm import CPU_FROZEN_SETTINGS, use_cpu_gemm_template
from specgen.pipelines.unified import PrefillBatch, StepCaches, StepState, UnifiedStep, _floating_dtype
from specgen.sampling import SamplingTensors


CPU_FREEZE_MAX_SLOTS = 64


def freezes(device: torch.device, slots: int) -> bool:
    """Whether a compiled step over `slots` slots folds its weights in (see StepFunctions). Decided by
    the slots, not the step's rows: the speculative step and plain decoding at one batch size must
    take the same GEMM kernels (CPU_FROZEN_SETTINGS), whatever K."""
    return device.type == "cpu" and slots <= CPU_FREEZE_MAX_SLOTS


# A pointwise buffer read more than once is stored, not inlined, above this many ops (CPU).
CPU_REALIZE_OPCOUNT = 20


def compiles_prefill(device: torch.device) -> bool:
    """Whether a compiled runner compiles its prefill too: on CUDA, where it pays (launches); on CPU
    its large GEMMs gain little from Inductor, so it stays eager."""
    return device.type == "cuda"


def use_compile_cache(directory: Path) -> None:
    """Point Inductor's (and Triton's) on-disk caches at `directory` unless the user already chose.

    Importing Inductor writes its default (/tmp/torchinductor_<user>) into TORCHINDUCTOR_CACHE_DIR,
    so "already chose" means a value other than that default: a plain `setdefault` here never took
    effect, and every run shared /tmp's cache whatever $SPECGEN_CACHE (or HOME) said."""
    from torch._inductor.runtime.runtime_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, os.path.abspath(default_cache_dir())):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory / "inductor")
        prune_graph_cache(directory / "inductor" / "fxgraph")
    os.environ.setdefault("TRITON_CACHE_DIR", str(directory / "triton"))


# What Inductor's graph cache may keep between runs. An entry of a frozen CPU step holds the C++
# template's packed copy of every weight it multiplies by (SmolLM2 in float32: 515 MB per variant).
GRAPH_CACHE_MAX_BYTES = 8 << 30


def prune_graph_cache(folder: Path, max_bytes: int = GRAPH_CACHE_MAX_BYTES) -> list[Path]:
    """Delete the oldest entries of Inductor's graph cache under `folder` (fxgraph/<xx>/<key>/) until
    the rest takes at most `max_bytes`; returns the entries deleted. A deleted entry costs only a
    compile, at the next run that needs it."""
    entries = []
    for entry in folder.glob("*/*"):
        files = [f for f in entry.rglob("*") if f.is_file()]
        if files:
            stats = [f.stat() for f in files]
            entries.append((max(st.st_mtime for st in stats), sum(st.st_size for st in stats), entry))
    total = sum(size for _, size, _ in entries)
    deleted = []
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= size
        deleted.append(entry)
    return deleted


# Inductor's CPU autotuning calls a deprecated storage API: a warning no user can act on.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)

_code_ids = itertools.count(1)


def own_code(fn):
    """`fn` (a function or bound method) with a code object of its own. Dynamo keeps compiled
    variants per code object and a call walks the guards of every variant of its code: runners that
    share a process (bench, tests) and the draft variants of one runner each get their own, so a
    step's lookup only ever sees its own graph."""
    func = getattr(fn, "__func__", fn)
    code = func.__code__.replace(co_name=f"{func.__code__.co_name}_{next(_code_ids)}")
    copy = types.FunctionType(code, func.__globals__, code.co_name, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return types.MethodType(copy, fn.__self__) if hasattr(fn, "__self__") else copy


def _under_settings(compiled, freezing: bool, device: torch.device):
    """Inductor reads `freezing` (and the GEMM settings) from its global config when it compiles,
    and it compiles at a call (the first, or a recompile), not at torch.compile():
    `options={"freezing": ...}` never reaches it (measured: no weight was folded or prepacked). So
    every call runs under the settings; the patch costs microseconds against a step of milliseconds."""
    # size_asserts off: the generated wrapper re-checks every input's shape and strides at each
    # call, which the guards already did (measured with the guard filter below: EAGLE-3 K = 2 on
    # SmolLM2, batch 1, 2 AMD EPYC cores, 42.0 -> 38.8 ms per step)
    # emulate_precision_casts: a value rounded to bf16 and read back is the rounded value in every
    # consumer, as in eager. Without it Inductor keeps the float32 value for consumers fused into
    # the producer's kernel and the rounded one for the others: the lm head's epilogue computed
    # top-p's radix keys from unrounded logits while its probabilities came from the rounded ones,
    # and a cut-off above every rounded logit kept no token (token 0 sampled: SmolLM2 in bf16, the
    # verify of 4 rows at 8 slots over 2 threads; benchmarks/exactness.py found it)
    settings = {"freezing": freezing, "size_asserts": False, "emulate_precision_casts": True}
    if freezing and device.type == "cpu":
        settings.update(CPU_FROZEN_SETTINGS)

    def call(*args):
        with inductor_config.patch(settings):
            return compiled(*args)
    return call


def compile_frozen_on_cpu(fn):
    """`fn` compiled as a frozen CPU step's parts are (static shapes, weights folded in, each GEMM
    through the C++ template: cpu_gemm.py), for tests and benchmarks of one piece of a step."""
    use_cpu_gemm_template()
    return _under_settings(torch.compile(own_code(fn), fullgraph=True, dynamic=False), True, torch.device("cpu"))


class StepFunctions:
    def __init__(self, unified: UnifiedStep, state: StepState, caches: StepCaches,
                 sampling: SamplingTensors, *, device: torch.device, compile: bool,
                 compile_prefill: bool | None = None) -> None:
        self.unified, self.state, self.caches, self.sampling = unified, state, caches, sampling
        self.device = device
        self.compiled = bool(compile)
        self.cuda_graphs = self.compiled and device.type == "cuda"
        self._key_index: dict[int, torch.Tensor] = {}
        self._aranges: dict[tuple[str, int], torch.Tensor] = {}
        self._rows = (state, caches, sampling)          # what the step runs over (see use_slots)
        self._verifies: dict[int, object] = {}          # t -> the compiled verify of t rows per slot
        # k -> the compiled step of k drafts (draft + verify; a structured step's: the draft alone)
        self._steps: dict[int, object] = {}
        # what building each compiled part took (pipelines/compile_clock.py): ("step", k), ("verify", t),
        # ("recompile", name), ("cuda graph", name) -> seconds; the names served by the graph cache
        self.clock = CompileClock(self.compiled, device)
        self.compile_seconds, self.from_graph_cache = self.clock.seconds, self.clock.from_graph_cache
        self._prefill = unified.prefill
        self.prefill_compiled = False
        # an eager bf16 prefill on a CPU without native bf16 products: its GEMMs in float32
        # (kernels/cpu_bf16_products.py), 2.7x faster from 256 rows. Only for a bf16 target: every
        # op of the prefill passes through the mode (~50 us each on 2 cores, ~0.1 s for SmolLM2's),
        # which a bf16 draft beside a float32 target (its one layer) does not repay.
        self._bf16_prefill_is_slow = (device.type == "cpu" and not cpu_has_bf16()
                                      and _floating_dtype(unified.target) == torch.bfloat16)
        self.frozen = False
        if not self.compiled:
            return
        # Weights never change during a run: on CPU Inductor can fold them in as constants
        # ("freezing"), prepack them, and pick each GEMM's kernel (CPU_FROZEN_SETTINGS). Measured
        # on 2 CPU cores (SmolLM2, fp32, benchmarks/step_cost.py --compile, ms per step): batch 1,
        # frozen with oneDNN's prepacking only: 47 (plain, 1 row), 95 (EAGLE-3 K = 3, 4 rows);
        # frozen with the C++ template: 19-22 and 30. Batch 8, not frozen / frozen with the
        # template: 8 rows 76.8 / 48.5; 32 rows 181.8 / 163.5; 64 rows 288.7 / 272.2 (oneDNN's
        # prepacking alone had made 16 rows slower frozen). So freeze every CPU step of up to 64
        # slots. Not on CUDA: nothing is prepacked there, and the graph cache's key knows the
        # values of frozen weights on CPU only (cpu_gemm.py).
        self.frozen = freezes(device, state.pending.shape[0])
        if self.frozen:
            use_cpu_gemm_template()
        self._options = {}
        if device.type == "cpu" and not sampling.all_greedy:
            # Inductor inlines a pointwise producer into each load of it and only then removes the
            # repeats, so a chain of ops that each read their input twice (the noise hash's
            # xor-shifts and split multiplies, kernels/keyed_noise.py) is traced 2^depth times:
            # with the CPU's default threshold (50 ops) a sampled step's verify took 150 s to
            # compile (a 96-token vocabulary; 14 s above 20 ops, where a reused buffer is stored
            # instead). Greedy steps never hash (verify_greedy) and keep Inductor's default.
            self._options["realize_opcount_threshold"] = CPU_REALIZE_OPCOUNT
        # Each compiled function has a code object of its own (own_code); a few recompiles remain
        # possible (a sampling flag that widens, the prefill's shapes).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        if self.cuda_graphs:
            # CUDA graphs (what mode="reduce-overhead" turns on) replay fixed addresses: everything
            # the step reads or writes in place is marked static.
            self._options["triton.cudagraphs"] = True
            for t in (*state.tensors(), *caches.tensors(), *unified.target.static_tensors(),
                      *sampling.tensors()):
                torch._dynamo.mark_static_address(t)
        self.prefill_compiled = compile_prefill if compile_prefill is not None else compiles_prefill(device)
        if self.prefill_compiled:
            # Only the batch's rows and padded length are dynamic (marked at each call, `prefill`):
            # `dynamic=True` made every Python int symbolic too, the layer indices a target captures
            # for the draft among them, and the capture's lookup failed to trace (seen on an H200).
            self._prefill = _under_settings(
                torch.compile(own_code(unified.prefill), fullgraph=True, dynamic=None), self.frozen, self.device)

    def _eager(self, fn):
        """`fn` run eagerly: on CPU with the row-invariant products of models/products.py (a step's
        GEMMs through the BLAS give a row other bits beside other rows; the compiled step's C++
        template does not)."""
        if self.device.type != "cpu":
            return fn

        def invariant(*args):
            with row_invariant_products():
                return fn(*args)
        return invariant

    def _compile(self, fn):
        # The modules' attributes never change during a run (weights are fixed, flags set at build):
        # Dynamo's guards on them would be walked at every call for nothing (about 0.6 ms a call on a
        # 2-core CPU, for a step of 25-40 ms).
        options = {**self._options, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        return _under_settings(torch.compile(own_code(fn), fullgraph=True, dynamic=False, options=options),
                               self.frozen, self.device)

    def key_index(self, kv_len: int) -> torch.Tensor:
        """The arange whose length bounds the keys the reference attention reads (one per bucket)."""
        index = self._key_index.get(kv_len)
        if index is None:
            index = self._key_index[kv_len] = torch.arange(kv_len, device=self.device)
            # dynamic: one compiled step for every bucket (the kernel path has one bound). CUDA graphs
            # still record one graph per bucket (without the kernel only), during the warm-up and
            # then at the first steps of each longer bucket (compile time: compile_clock.py).
            if self.compiled and not self.unified.use_kernel:
                # below the cache length: a slice as long as the cache would be specialised away
                torch._dynamo.mark_dynamic(index, 0, min=2, max=self.caches.target.max_len - 1)
        return index

    def _arange(self, kind: str, n: int, dynamic: bool) -> torch.Tensor:
        """`arange(n)`; `dynamic`: its length is a dynamic size (the draft window). "Maybe" dynamic:
        a model that branches on it gets one graph per branch instead of an error."""
        index = self._aranges.get((kind, n))
        if index is None:
            index = self._aranges[(kind, n)] = torch.arange(n, device=self.device)
            if self.compiled and dynamic:
                torch._dynamo.maybe_mark_dynamic(index, 0)
        return index

    @property
    def compiled_ks(self) -> set[int]:
        """The variants k > 0 that run without compiling first (every k when steps run eagerly)."""
        if not self.compiled:
            return set(range(1, self.unified.k + 1))
        if self.unified.draft is None:       # drafts from the host: a variant is its verify
            return {t - 1 for t in self._verifies if t > 1}
        if self.unified.structured:          # a draft, then a verify of k + 1 rows: both compiled
            return {k for k in self._steps if k + 1 in self._verifies}
        return set(self._steps)

    def verify_ready(self, t: int) -> bool:
        """Whether the verify of t rows per slot runs without compiling first."""
        return not self.compiled or t in self._verifies

    def compiled_seconds(self) -> float:
        """Seconds spent compiling so far (every first call)."""
        return sum(self.compile_seconds.values())

    def verify(self, kv_len: int, t: int) -> torch.Tensor:
        """Verify T = t pending tokens per slot (t = 1: plain decoding); returns the step's [B, t+3]
        (more columns with logprobs: UnifiedStep)."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        state, caches, sampling = self._rows
        rows = self._arange("rows", t, dynamic=False)
        fn = self._verifies.get(t)
        if fn is None:
            verify = self.unified.verify_block
            fn = self._verifies[t] = self._compile(verify) if self.compiled else self._eager(verify)
        return self._timed(("verify", t), fn, state, caches, sampling, self.key_index(kv_len), rows)

    def step(self, kv_len: int, window: int, k: int, between=None) -> torch.Tensor:
        """Variant k (k >= 1): propose k tokens per slot after absorbing up to `window` positions,
        then verify the k + 1 pending tokens; returns the step's [B, k+4] (more with logprobs).
        Compiled, one graph (and one call) per k, built on its first use. A structured step
        (`unified.structured`) is two: the draft, then `between(k)` on the host (it writes the rows'
        token masks from the drafts), then the verify."""
        unified = self.unified
        state, caches, sampling = self._rows
        if unified.draft is None:
            # drafts from the host (drafts/suffix.py), already in pending: the step is the verify
            return self.verify(kv_len, k + 1)
        if not self.compiled or unified.structured:
            self.draft(kv_len, window, k)
            if between is not None:
                between(k)
            return self.verify(kv_len, k + 1)
        fn = self._steps.get(k)
        if fn is None:
            def step_k(state, caches, sampling, key_index, window, rows):
                unified.draft_block(state, caches, sampling, key_index, window, k)
                return unified.verify_block(state, caches, sampling, key_index, rows)

            fn = self._steps[k] = self._compile(step_k)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        rows = self._arange("rows", k + 1, dynamic=False)
        return self._timed(("step", k), fn, state, caches, sampling, self.key_index(kv_len),
                           self._window(window), rows)

    def draft(self, kv_len: int, window: int, k: int) -> None:
        """The draft alone (a structured step's first part): k proposals into `pending[:, 1:k+1]`."""
        unified = self.unified
        state, caches, sampling = self._rows
        if not self.compiled:
            self._eager(unified.draft_block)(state, caches, sampling, self.key_index(kv_len), self._window(window), k)
            return
        fn = self._steps.get(k)
        if fn is None:
            def draft_k(state, caches, sampling, key_index, window):
                unified.draft_block(state, caches, sampling, key_index, window, k)

            fn = self._steps[k] = self._compile(draft_k)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        self._timed(("step", k), fn, state, caches, sampling, self.key_index(kv_len), self._window(window))

    def catch_up(self, kv_len: int, window: int) -> None:
        """The draft absorbs the committed positions it has not read (up to `window` back) and proposes
        nothing (`draft_block` with k = 0): the runner's call before a step without the draft would
        leave a slot further behind than the ring holds. Eager, even in a compiled run: it runs at
        most once per `max_window` positions, and a graph of its own would cost a compile."""
        state, caches, sampling = self._rows
        self._eager(self.unified.draft_block)(state, caches, sampling, self.key_index(kv_len), self._window(window), 0)

    def _window(self, window: int) -> torch.Tensor:
        # at least 2 rows: the window is then never 1, a size compilers treat apart (a row past a
        # slot's gap is harmless scratch)
        return self._arange("window", max(2, min(window, self.unified.max_window)), dynamic=True)

    def _timed(self, name, fn, *args):
        """Call a compiled part; a call that builds code (a first call, a recompile, a CUDA graph
        recorded for new sizes) is compile time, never a step's cost (compile_clock.py)."""
        return self.clock.call(name, fn, *args)

    def use_slots(self, slots: int) -> None:
        """Steps run over the first `slots` slots only (eager steps: other shapes would recompile)."""
        assert not self.compiled, "a compiled step keeps its batch shape"
        self._rows = (self.state.narrow(slots), self.caches.narrow(slots),
                      self.sampling.select(slice(0, slots)))

    @property
    def _prefill_in_float32(self) -> bool:
        return self._bf16_prefill_is_slow and not self.prefill_compiled

    def prefill(self, batch: PrefillBatch, absorb: bool = True) -> torch.Tensor | None:
        """None, or with prompt logprobs the hidden states they are made from (UnifiedStep.prefill;
        `absorb` False: the draft does not read the prompt)."""
        if self._prefill_in_float32:
            with float32_products():
                return self._prefill(self.state, self.caches, batch, self.sampling, absorb)
        if self.prefill_compiled:
            for t in (batch.rows, batch.tokens, batch.positions, batch.next_tokens, batch.last_index,
                      batch.is_last, batch.noise_key, batch.limit, batch.reasoning):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            for t in (batch.tokens, batch.positions, batch.next_tokens):
                torch._dynamo.maybe_mark_dynamic(t, 1)
        return self._prefill(self.state, self.caches, batch, self.sampling, absorb)

    def warm_up(self, kv_len: int, prefill_batches: list[PrefillBatch], ks: tuple[int, ...] = (),
                plain: bool = False, verifies: tuple[int, ...] = ()) -> float:
        """Compile / capture, before the run, the variants k in `ks`, with `plain` the plain step (the
        verify of one row), and the verifies of t rows in `verifies` (a hybrid's steps of host drafts
        alone); all slots inactive: nothing advances. Returns the seconds that took."""
        if not self.compiled:
            return 0.0
        start = time.perf_counter()
        for batch in prefill_batches:
            self.prefill(batch)
        self.state.active.zero_()
        # CUDA graphs: the first calls run eagerly, the next records; then replays
        for _ in range(3 if self.cuda_graphs else 1):
            for k in ks:
                self.step(kv_len, k + 1, k)
            if plain:
                self.verify(kv_len, 1)
            for t in verifies:
                self.verify(kv_len, t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start
