"""How a frozen CPU step's GEMMs compile: Inductor's C++ GEMM template, one choice, small register tiles.

Contract: `use_cpu_gemm_template()` (once per process, idempotent) makes every GEMM Inductor compiles
under `CPU_FROZEN_SETTINGS` take the C++ template without autotuning, with register tiles of at most
`MAX_TILE_ROWS` rows on AVX-512. Both keep a row's result independent of how many rows its GEMM
has (the template accumulates each output row over k in the same order whatever the tile, as long
as it never splits k across threads: `cpp.gemm_max_k_slices` is pinned to 1, its default, since
whether it splits depends on the rows), which is what makes a token verified beside drafts the
token plain decoding computes. It also lets Inductor's graph cache serve float32 frozen graphs,
keyed by the values of the weights they fold in.

Why the template: a step's GEMMs have few rows (K + 1 per slot), a shape oneDNN/MKL run far from the
memory bound: on 2 cores, SmolLM2's fp32 GEMMs took 67 ms at 4 rows against 33 ms at 1 row (frozen,
oneDNN), and 19 ms at both with the template. It needs frozen weights (constants to prepack). ATen
stays a backend for what the template cannot take, but where it can, the template is taken WITHOUT
autotuning (`_template_when_possible`): autotuning took oneDNN for some shapes of one graph and the
template in the other, by margins inside the noise of a 2-core VM, and two of SmolLM2's five shapes
then gave row 0 other bits in bf16. One choice also leaves nothing to benchmark while compiling (the
EAGLE-3 demo's cold warm-up on 2 AMD EPYC Zen 4 cores: 337 -> 208 s), and nothing a noisy run can
cache.

Why small tiles (`_narrow_register_tiles`): on AVX-512 the template's fp32-accumulating micro-kernel
(fp32, and bf16 converted to fp32 where the CPU has no AMX) picks an 8 x 48 register tile, 24
accumulator vectors: a GEMM of 1-4 rows runs only its tail instantiations (at most 12), one of 8
rows or more the full tile, and the time per row jumps there (SmolLM2's 3072 x 576 GEMM, 2 AMD EPYC
Zen 4 cores, GCC 12, `python benchmarks/gemm_rows.py --tile-rows 0`: bf16 160 / 571 / 1,036 us at
4 / 8 / 16 rows; fp32 173 / 419 / 751). With tiles of 4 x 48 (12 accumulators) the same GEMMs took
160-178 / 234-241 / 395-462 us in bf16 and 171-174 / 252-273 / 423-437 in fp32 (two runs), and at
1-4 rows they run the same tail code as before. Tiles of 6 x 32 (12 accumulators) ran like 4 x 48;
4 x 64 (16) and 8 x 48 (24) did not.
Intel's AMX path (bf16 on Xeons with AMX) is another micro-kernel, left as Inductor chooses it. On
CPUs with AVX512-BF16 and no AMX (AMD Zen 4), bf16 takes neither: `kernels/cpu_bf16_dot.py`, which
`use_cpu_gemm_template()` registers, multiplies it in bf16 (the tile sizes above then concern float32).

Why frozen steps can come from Inductor's graph cache (`_key_frozen_weights_by_content`,
`_keep_float32_linear_weights_unpacked`): a run of weights and variant compiled before loads the
whole graph instead of lowering it again (SmolLM2's plain step, 2 Intel Xeon Skylake-SP cores:
float32 89-105 s -> 37-45 s with the kernels cached either way; bf16 141 -> 41 s). That needs a key
that knows the weights' values (the cache entry holds the template's packed copy of each one) and
lets in the weights oneDNN packed (Inductor turns such graphs away: they cannot be pickled, though
the entry never holds them). float32 weights are not packed at all: it bought nothing there. Where
a hook is missing, frozen steps stay out of the graph cache (`fx_graph_cache` off in
CPU_FROZEN_SETTINGS).

Why the templates are parsed once (`_parse_each_template_once`): Inductor renders the template's C++
from Jinja sources and parses each source again at every render, for every GEMM of the graph (211
in SmolLM2's verify step) and for the micro-kernel inside each: 10-11 s of a cold 78 s EAGLE-3
compile on 2 AMD EPYC Zen 4 cores went to Jinja's parser, paid again by every run (frozen graphs are
rendered anew each time). The sources are constants and a parsed template renders any arguments.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import sys

from specgen.kernels.cpu_bf16_dot import register_bf16_dot_kernel
from specgen.machine import cpu_flags

CPU_FROZEN_SETTINGS = {
    "max_autotune_gemm": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
    "cpp.gemm_max_k_slices": 1,
}

# rows of the AVX-512 fp32-accumulating micro-kernel's register tile (Inductor's default: 8 or 16)
MAX_TILE_ROWS = 4


def _template_when_possible(choices: list) -> list:
    """Inductor's autotuning choices for one GEMM -> the C++ template alone where it is one of them
    (CPU), else unchanged (CUDA's choices, or ATen alone).

    A template whose weight is read transposed (every `nn.Linear`) comes wrapped in a
    `DataProcessorChoiceCallerWrapper`; looking only for the bare class found none, so autotuning
    ran after all and took MKL for 16 rows and more (measured, 2 AMD EPYC Zen 4 cores, SmolLM2 fp32,
    batch 8: a step of 2 rows per slot 125.8 ms against 35.8 for 1 row, as slow as eager)."""
    from torch._inductor.codegen.cpp_template_kernel import CppTemplateCaller

    templates = [c for c in choices if isinstance(getattr(c, "_wrapped", c), CppTemplateCaller)]
    return templates[:1] if templates else choices


def _narrow_register_tiles(max_rows: int = MAX_TILE_ROWS) -> int:
    """Cap the rows of the register tiles Inductor may pick for its AVX-512 fp32-accumulating CPU
    micro-kernel (fp32, bf16 and fp16 inputs; not the int8 weight-only kernels, not AMX): a tile
    of m x n becomes min(m, max_rows) x n. Returns how many tiles changed (0 where Inductor's
    registry is not as expected: then its own choice stands)."""
    import torch
    import torch._inductor.lowering  # noqa: F401  (the codegen modules import in this order)
    from torch._inductor.codegen import cpp_micro_gemm as micro

    configs_of = getattr(micro, "micro_gemm_configs", None)
    kernel = getattr(micro, "CppMicroGemmFP32Vec", None)
    avx512 = getattr(micro, "VecAVX512", None)
    if not isinstance(configs_of, dict) or kernel not in configs_of or avx512 is None:
        return 0
    changed = 0
    for i, config in enumerate(configs_of[kernel]):
        tile = config.register_blocking
        if (config.vec_isa_cls is avx512 and config.extra_check is None and tile.block_m > max_rows
                and config.input_dtype == config.input2_dtype
                and config.input_dtype in (torch.float32, torch.bfloat16, torch.float16)):
            narrow = tile._replace(block_m=max_rows)
            configs_of[kernel][i] = dataclasses.replace(config, register_blocking=narrow)
            changed += 1
    return changed


@functools.cache
def _parse_each_template_once() -> bool:
    """Memoise Inductor's `KernelTemplate._template_from_string` (source -> parsed Jinja template) by
    its source. Returns False where Inductor has no such function (its own parsing then stands)."""
    from torch._inductor.codegen.common import KernelTemplate

    parse = KernelTemplate.__dict__.get("_template_from_string")
    if not isinstance(parse, staticmethod):
        return False
    KernelTemplate._template_from_string = staticmethod(functools.lru_cache(maxsize=256)(parse.__func__))
    return True


@functools.cache
def _parse_index_expressions_once() -> bool:
    """Memoise the C++ template's `parse_expr_with_index_symbols` (a size or index written as text ->
    a sympy expression of index symbols) by its text. Returns False where Inductor has no such
    function. The template re-parses the same few strings ("M", "N", "m_end", ...) with sympy's full
    parser at every render: 9,680 parses for SmolLM2's plain step (a quarter of its cProfiled
    codegen, Intel Xeon Skylake-SP). Sympy expressions are immutable, so one serves every render."""
    from torch._inductor.codegen import cpp_template_kernel as module

    parse = getattr(module, "parse_expr_with_index_symbols", None)
    if parse is None:
        return False
    parse_text = functools.lru_cache(maxsize=4096)(lambda text: parse(text))

    def parse_memoised(expr):
        # lists recurse through the module's name, so every element comes back here
        return parse_text(expr) if isinstance(expr, str) else parse(expr)

    module.parse_expr_with_index_symbols = parse_memoised
    return True


@functools.cache
def _keep_float32_linear_weights_unpacked() -> bool:
    """Stop Inductor's freezing passes from packing float32 linear weights for MKL: its weight-pack
    patterns (`_mkldnn_weight_pack_init`, registered once per process at the first frozen compile)
    get their `_is_packable_linear` check wrapped to decline float32 weights. Returns False where
    Inductor's registry is not as expected (its packing then stands).

    The C++ template packs its own copy of the weight and drops the pass's, so in float32 the
    packing bought nothing (the plain step's generated code is the same, kernel for kernel), and it
    kept the graph away from Inductor's cache, which turns away packed tensors (now let in,
    `_key_frozen_weights_by_content`, at the price of reading each one back to dense values for the
    key). Unpacked, a linear lowers through `mm` with its constant weight, which takes the same
    template (`_template_when_possible`).
    bf16 stays packed: there the pass also fuses a linear with the residual add that follows it
    (oneDNN's binary post-op, rounded once), and without it the rounding points of a bf16 step
    depended on its rows: a verified token no longer had plain decoding's bits (seen in
    test_compiled_speculative_step_equals_plain_decoding_in_bfloat16)."""
    try:
        from torch._inductor.fx_passes import freezing_patterns, mkldnn_fusion
    except ImportError:
        return False
    init = getattr(mkldnn_fusion, "_mkldnn_weight_pack_init", None)
    passes = getattr(freezing_patterns, "pass_patterns", None)
    if not callable(init) or not isinstance(passes, list):
        return False

    def init_declining_float32() -> None:
        init()
        for patterns in passes:
            for entries in getattr(patterns, "patterns", {}).values():
                for entry in entries:
                    check = getattr(entry, "extra_check", None)
                    if getattr(check, "__name__", "") == "_is_packable_linear":
                        object.__setattr__(entry, "extra_check", _declining_float32(check))

    mkldnn_fusion._mkldnn_weight_pack_init = init_declining_float32
    return True


@functools.cache
def _give_offset_constants_their_own_storage() -> bool:
    """Make every CPU constant Inductor lowers start at offset 0 of a storage of its own: one that
    is a view into a weight (a slice that freezing folded in, e.g. DFlash's `qkv_proj.weight[q:]`,
    the k|v rows of a fused projection) is copied. Returns False where Inductor's lowering is not
    as expected (constants then stay as they come).

    Why: a constant enters the graph with a layout of offset 0 whatever its storage offset, and
    the C++ template re-views its weight with `as_strided(size, stride, layout offset)`, which
    counts from the start of the storage: the slice was read from the weight's first rows. The
    shipped SmolLM2 DFlash projected its context keys and values with the query rows, compiled,
    and accepted its first draft 8.6% of the time against 22.4% eager
    (tests/test_dflash.py::test_a_compiled_frozen_step_proposes_the_eager_drafts)."""
    import torch
    from torch._inductor.graph import GraphLowering

    add = GraphLowering.__dict__.get("add_tensor_constant")
    if not callable(add):
        return False

    def add_tensor_constant(self, data, name=None):
        if (isinstance(data, torch.Tensor) and data.device.type == "cpu" and not data.is_mkldnn
                and data.storage_offset() != 0):
            data = data.clone()       # preserve_format: the same strides, offset 0
        return add(self, data, name)

    GraphLowering.add_tensor_constant = add_tensor_constant
    return True


def _declining_float32(check):
    """`check` (a linear-packing pattern's test) that declines float32 weights."""
    import torch

    def packable(match) -> bool:
        linear = match.output_node()
        weight = linear.args[2 if linear.target is torch.ops.aten.addmm.default else 1]
        value = getattr(weight, "meta", {}).get("val")
        if value is not None and value.dtype == torch.float32:
            return False
        return check(match)

    packable.__name__ = "_is_packable_linear_unless_float32"
    return packable


def _weights_digest(t) -> str:
    """A digest of a CPU tensor's bytes (blake2b, 16 bytes; hashlib releases the GIL on large buffers)."""
    import torch

    data = t.detach().contiguous().view(-1).view(torch.uint8)
    return hashlib.blake2b(data.numpy(), digest_size=16).hexdigest()


@functools.cache
def _key_frozen_weights_by_content() -> bool:
    """Make Inductor's graph-cache key of a frozen graph depend on its weights' VALUES (and on this
    module's kernels and the CPU's instruction sets), not only on their shapes, and let graphs that
    hold oneDNN-packed weights in. Returns False where Inductor's key is not built as expected: the
    graph cache is then turned off for frozen steps (`CPU_FROZEN_SETTINGS`).

    Why the values: a frozen graph's cache entry holds the C++ template's packed copy of every
    weight, by value, while its key describes frozen weights by dtype and shape alone. Two
    checkpoints of one layout (a fine-tune and its base, two random test models) would share the
    entry, and the second run would multiply by the first one's weights. The kernels this module
    registers (`cpu_bf16_dot`, the narrowed tiles: their sources and the choice
    `use_cpu_gemm_template` made) shape the generated code without entering Inductor's key either,
    and which of them runs depends on the CPU (AVX512-BF16 or not): a cache moved to another CPU
    must miss rather than load code it cannot run.

    Why packed weights: in bf16 the freezing passes still pack each linear weight for oneDNN (what
    fixes a bf16 step's rounding points: `_keep_float32_linear_weights_unpacked`), and Inductor
    turns away any graph holding such a tensor ("mkldnn tensors unpickleable"), so every bf16 run
    (`target.dtype: auto` on AVX-512 CPUs, a bf16 draft) lowered its step anew. The template packs
    its own copy and the entry never holds oneDNN's; only the key has to describe it, here by its
    dense values. Were a graph to keep calling oneDNN with it, saving the entry would fail to
    pickle, which Inductor counts (`fxgraph_cache_pickle_error`) and passes over."""
    from torch._inductor import codecache
    from torch._inductor.freezing_utils import is_frozen_param

    pickler = getattr(codecache, "FxGraphCachePickler", None)
    reduce = getattr(pickler, "_reduce_tensor", None) if pickler is not None else None
    metadata = getattr(codecache, "extract_tensor_metadata_for_cache_key", None)
    validator = getattr(codecache, "CacheabilityValidator", None)
    check_tensor = getattr(validator, "check_tensor", None) if validator is not None else None
    if reduce is None or metadata is None or check_tensor is None:
        return False
    kernels = _kernel_sources_digest()
    instruction_sets = hashlib.blake2b(" ".join(sorted(cpu_flags())).encode(), digest_size=16).hexdigest()

    def reduce_by_content(self, t):
        if t.device.type == "cpu" and (t.is_mkldnn or is_frozen_param(t)):
            dense = t.to_dense() if t.is_mkldnn else t
            return (_identity, (metadata(dense), t.is_mkldnn, _weights_digest(dense), kernels,
                                _kernels_chosen, instruction_sets))
        return reduce(self, t)

    def check_tensor_letting_packed_weights_in(t) -> None:
        if not t.is_mkldnn:
            check_tensor(t)

    pickler._reduce_tensor = reduce_by_content
    validator.check_tensor = staticmethod(check_tensor_letting_packed_weights_in)
    return True


def _identity(x):
    return x


def _kernel_sources_digest() -> str:
    """A digest of the sources that shape a frozen step's generated code beyond Inductor's own."""
    from specgen.kernels import cpu_bf16_dot

    h = hashlib.blake2b(digest_size=16)
    for module in (sys.modules[__name__], cpu_bf16_dot):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()


@functools.cache
def _take_template_without_autotuning() -> None:
    from torch._inductor.select_algorithm import add_preprocessing_fn

    add_preprocessing_fn(_template_when_possible)


_tiles_chosen = False
_kernels_chosen: tuple = ()     # (max_tile_rows, bf16_dot) of the first use_cpu_gemm_template call


def use_cpu_gemm_template(max_tile_rows: int | None = MAX_TILE_ROWS, bf16_dot: bool = True) -> None:
    """Install `_template_when_possible` in Inductor's choice selection, narrow its register tiles
    to `max_tile_rows` rows (None: Inductor's own tiles) and, with `bf16_dot`, add the AVX512-BF16
    micro-kernel (kernels/cpu_bf16_dot.py; off: Inductor's fp32 one, for `benchmarks/gemm_rows.py`).
    Once per process: the first call's kernels stand. All act only where the C++ template compiles
    a GEMM, and each template source is parsed once per process (`_parse_each_template_once`)."""
    global _tiles_chosen, _kernels_chosen
    _take_template_without_autotuning()
    _parse_each_template_once()
    _parse_index_expressions_once()
    _keep_float32_linear_weights_unpacked()
    _give_offset_constants_their_own_storage()
    if not _key_frozen_weights_by_content():
        CPU_FROZEN_SETTINGS["fx_graph_cache"] = False
    if not _tiles_chosen:
        _tiles_chosen = True
        _kernels_chosen = (max_tile_rows, bf16_dot)
        if max_tile_rows is not None:
            _narrow_register_tiles(max_tile_rows)
        if bf16_dot:
            register_bf16_dot_kernel()
