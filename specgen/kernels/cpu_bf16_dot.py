"""bf16 GEMM micro-kernels for Inductor's C++ template on AVX-512 CPUs without AMX; their reference.

Contract: `register_bf16_dot_kernel()` (idempotent) adds two kernels to Inductor's registry of CPU
micro-kernels. For every GEMM of bf16 activations and bf16 weights (fp32 accumulation) that the C++
template compiles, with an even K, one of them is the kernel taken, whatever the number of rows M:
`CppMicroGemmBF16Dot` on CPUs with AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake; the only
bf16 kernel of its ISA class, which Inductor ranks above the plain AVX-512 one), and
`CppMicroGemmBF16Pairs` on CPUs with AVX-512 and no AVX512-BF16 (Intel Skylake-SP to Ice Lake;
Inductor's own bf16 configs of that class decline what it takes). Their checks read only K, the CPU
and alpha. Each output element is the fp32 sum `dot_pairs_reference` computes: for k = 0, 2, 4,
... in order, acc += a[k+1] * b[k+1], then acc += a[k] * b[k] (the order `vdpbf16ps` specifies;
bf16 products are exact in fp32, so the converting kernel's fused multiply-adds round as those
additions do; `vdpbf16ps` flushes denormals). That depends on the row alone, never on how many rows
share the GEMM, so a token verified beside drafts gets the bits plain decoding gives it.

Why: without AMX, Inductor's bf16 GEMM converts both operands to fp32 and multiplies with fp32 FMAs
(`CppMicroGemmFP32Vec`), which leaves the CPU's bf16 dot-product instruction unused: at 16 rows and
more a step's GEMMs are compute-bound, and a speculative step of 2 rows per slot cost about twice a
plain one at 8 and 16 slots. `vdpbf16ps` does two multiply-adds per fp32 lane where an FMA does one,
and reads the weight in bf16 with no conversion. SmolLM2's 3072 x 576 GEMM on 2 AMD EPYC Zen 4
cores, `python benchmarks/gemm_rows.py --rows 1 4 8 16 32` against `--no-bf16-dot` (Inductor's
kernel): 109 / 118 / 153 / 238 / 378 us against 135 / 181 / 264 / 410 / 734.

Why the converting kernel: on AVX-512 without bf16 instructions Inductor's kernel turns every 16
weights into fp32 with two instructions, again for every tile of 4 rows, on the ports the FMAs need:
a step of a few rows was bound by them, not by memory. Loaded as pairs, a 32-bit lane gives the odd
k's fp32 by masking its low half and the even k's by a shift, one instruction per 16 weights. A
plain SmolLM2 step in bf16 (one slot, 2 Intel Xeon Skylake-SP threads, `python
benchmarks/step_cost.py --methods eagle3 --batch-sizes 1 --ks 1 2 3 --compile --dtype bfloat16`):
its call 27.4 -> 23.8 ms; EAGLE-3 K = 1, 2, 3 steps' calls 32.6 / 40.1 / 48.2 -> 27.3 / 30.5 / 35.8.

Layout: the template packs the frozen weight in blocks of `block_n` columns, each in VNNI2 order
(for each pair of k, the columns' two values side by side: one 512-bit load holds 16 columns' pairs);
a weight that is not a constant is packed the same way inside the kernel (`pack_vnni_B_locally`).
The register tile is 4 rows x 48 columns (12 accumulators): on Zen 4, 4 x 48, 6 x 48 and 8 x 32
ran alike from 8 rows on, 4 x 64 was slow at 4 rows.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

TILE = (4, 48, 2)     # rows, columns (a multiple of 16), k per step (a bf16 pair)

_KERNEL = r"""
#include <cstring>
#include <immintrin.h>

// One register tile: C[BM, 16 * NV] (+)= A[BM, K] @ B, B in VNNI2 order (pair row k / 2 at B + k * ldb).
template <int64_t BM, int64_t NV, bool accum>
__attribute__((target("avx512f,avx512bw{{ ",avx512bf16" if native else "" }}"), noinline))
static void {{kernel_name}}_tile(const {{input_t}}* __restrict__ A, const {{input2_t}}* __restrict__ B,
                                 float* __restrict__ C, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
    __m512 acc[BM][NV];
#pragma GCC unroll 16
    for (int64_t m = 0; m < BM; ++m) {
#pragma GCC unroll 16
        for (int64_t v = 0; v < NV; ++v) {
            acc[m][v] = accum ? _mm512_loadu_ps(C + m * ldc + 16 * v) : _mm512_setzero_ps();
        }
    }
{%- if native %}
    for (int64_t k = 0; k < K; k += 2) {
        __m512bh b[NV];
#pragma GCC unroll 16
        for (int64_t v = 0; v < NV; ++v) {
            b[v] = (__m512bh)_mm512_loadu_si512(B + k * ldb + 32 * v);
        }
#pragma GCC unroll 16
        for (int64_t m = 0; m < BM; ++m) {
            int32_t pair;       // A[m, k] and A[m, k + 1], broadcast to every lane
            std::memcpy(&pair, A + m * lda + k, sizeof(pair));
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 16
            for (int64_t v = 0; v < NV; ++v) {
                acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
            }
        }
    }
{%- else %}
    // A bf16 value is the high half of the fp32 with the same bits: a 32-bit lane holding a pair
    // (k in its low half, k + 1 in its high half) gives k + 1's fp32 by masking and k's by a shift,
    // one instruction per 16 values (Inductor's kernel converts with two per 16, and per row tile).
    const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t k = 0; k < K; k += 2) {
        __m512 odd[NV], even[NV];
#pragma GCC unroll 16
        for (int64_t v = 0; v < NV; ++v) {
            const __m512i pairs = _mm512_loadu_si512(B + k * ldb + 32 * v);
            odd[v] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_half));
            even[v] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        }
#pragma GCC unroll 16
        for (int64_t m = 0; m < BM; ++m) {
            uint32_t pair;
            std::memcpy(&pair, A + m * lda + k, sizeof(pair));
            const __m512 a_odd = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(pair & 0xFFFF0000u)));
            const __m512 a_even = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(pair << 16)));
#pragma GCC unroll 16
            for (int64_t v = 0; v < NV; ++v) {
                // bf16 x bf16 is exact in fp32, so each fused multiply-add rounds once, as the
                // reference's additions do
                acc[m][v] = _mm512_fmadd_ps(a_odd, odd[v], acc[m][v]);
                acc[m][v] = _mm512_fmadd_ps(a_even, even[v], acc[m][v]);
            }
        }
    }
{%- endif %}
#pragma GCC unroll 16
    for (int64_t m = 0; m < BM; ++m) {
#pragma GCC unroll 16
        for (int64_t v = 0; v < NV; ++v) {
            _mm512_storeu_ps(C + m * ldc + 16 * v, acc[m][v]);
        }
    }
}

template <int64_t BM, bool accum>
static inline void {{kernel_name}}_rows(const {{input_t}}* A, const {{input2_t}}* B, float* C,
                                        int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc) {
    int64_t n = 0;
    for (; n + {{block_n}} <= N; n += {{block_n}}) {
        {{kernel_name}}_tile<BM, {{block_n}} / 16, accum>(A, B + 2 * n, C + n, K, lda, ldb, ldc);
    }
    for (; n < N; n += 16) {
        {{kernel_name}}_tile<BM, 1, accum>(A, B + 2 * n, C + n, K, lda, ldb, ldc);
    }
}

{{declare_kernel}} {
    {{kernel.assert_function}}(N % 16 == 0, "bf16 dot micro-kernel: N must be a multiple of 16");
    {{kernel.assert_function}}(K % 2 == 0, "bf16 dot micro-kernel: K must be even");
{%- if pack_vnni_B_locally %}
    {{template.codegen_allocate_weight_buffer("packed_B_buf", input2_t, "K * N")}}
    at::vec::pack_vnni2(B, packed_B_buf, ldb, K, N);
    const {{input2_t}}* packed = packed_B_buf;
    const int64_t ld_packed = N;
{%- else %}
    const {{input2_t}}* packed = B;
    const int64_t ld_packed = ldb;
{%- endif %}
    for (int64_t m = 0; m < M; m += {{block_m}}) {
        switch (std::min<int64_t>(M - m, {{block_m}})) {
{%- for rows in range(block_m, 0, -1) %}
            case {{rows}}:
                {{kernel_name}}_rows<{{rows}}, accum>(A + m * lda, packed, C + m * ldc, N, K, lda, ld_packed, ldc);
                break;
{%- endfor %}
        }
    }
}
"""


def dot_pairs_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ weight [N, K] bf16 transposed -> [M, N] fp32, summed as the kernel sums:
    per pair of k in order, the odd product added first, each addition rounded to fp32."""
    a, b = x.float(), weight.float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(0, x.shape[1], 2):
        acc = acc + a[:, k + 1: k + 2] * b[:, k + 1]
        acc = acc + a[:, k: k + 1] * b[:, k]
    return acc


def _isa(vec_isa=None):
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return vec_isa if vec_isa is not None else pick_vec_isa()


def supported_native(vec_isa=None) -> bool:
    """Whether this CPU and compiler take the `vdpbf16ps` kernel: AVX512-BF16 code builds and runs,
    no AMX (where AMX is, Inductor's AMX kernel is left to do bf16)."""
    from torch._inductor.cpu_vec_isa import VecAMX, VecAVX512VNNI

    isa = _isa(vec_isa)
    return (isinstance(isa, VecAVX512VNNI) and not isinstance(isa, VecAMX)
            and isa.is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported())


def supported_converting(vec_isa=None) -> bool:
    """Whether this CPU takes the converting kernel: AVX-512 without AVX512-BF16 or AMX (Intel
    Skylake-SP to Ice Lake; a CPU without AVX-512 keeps Inductor's AVX2 kernel)."""
    from torch._inductor.cpu_vec_isa import VecAMX, VecAVX512

    isa = _isa(vec_isa)
    if not isinstance(isa, VecAVX512) or isinstance(isa, VecAMX) or torch.cpu._is_amx_tile_supported():
        return False
    return not (hasattr(isa, "is_avx512_bf16_supported") and isa.is_avx512_bf16_supported())


def supported(vec_isa=None) -> bool:
    """Whether this CPU takes one of the two kernels."""
    return supported_native(vec_isa) or supported_converting(vec_isa)


def _check(cpu_takes):
    """A config's extra check: even K, alpha 1, a CPU `cpu_takes` accepts. Never the rows (m): one
    kernel for a GEMM whatever its rows, so a row's bits never depend on them."""
    def extra_check(config, m, n, k, alpha, num_threads, **kwargs) -> bool:
        return k % 2 == 0 and alpha == 1 and cpu_takes(kwargs.get("vec_isa"))

    return extra_check


_takes, _takes_converting = _check(supported_native), _check(supported_converting)


def _unless_converting_takes(check):
    """An extra check for Inductor's own bf16 configs of the same ISA class: they decline every GEMM
    the converting kernel takes (rather than compete with it in Inductor's ranking, which picks
    by tile sizes and could choose per shape)."""
    def extra_check(config, m, n, k, alpha, num_threads, **kwargs) -> bool:
        if _takes_converting(config, m, n, k, alpha, num_threads, **kwargs):
            return False
        return check is None or check(config, m, n, k, alpha, num_threads, **kwargs)

    return extra_check


@functools.cache
def register_bf16_dot_kernel() -> bool:
    """Add the kernels to Inductor's registry (once). False where Inductor's registry is not as
    expected: then Inductor's own kernels stand."""
    import torch._inductor.lowering  # noqa: F401  (the codegen modules import in this order)
    from torch._inductor.codegen import cpp_micro_gemm as micro
    from torch._inductor.codegen.common import KernelTemplate
    from torch._inductor.cpu_vec_isa import VecAVX512, VecAVX512VNNI

    needed = ("micro_gemm_configs", "CppMicroGemm", "CppMicroGemmFP32Vec", "generate_gemm_config", "LayoutType")
    if not all(hasattr(micro, name) for name in needed):
        return False

    class CppMicroGemmBF16Dot(micro.CppMicroGemm):
        """bf16 x bf16 -> fp32 with `vdpbf16ps` (this module's contract)."""

        native = True

        def codegen_define(self, kernel) -> str:
            options = {"declare_kernel": self.get_kernel_declaration(), "kernel": kernel,
                       "block_m": self.register_blocking.block_m, "block_n": self.register_blocking.block_n,
                       "native": self.native, **self.get_common_options()}
            return KernelTemplate._template_from_string(_KERNEL).render(options)

        def get_b_layout(self):
            return micro.LayoutType.VNNI2

    class CppMicroGemmBF16Pairs(CppMicroGemmBF16Dot):
        """bf16 x bf16 -> fp32 on AVX-512 without AVX512-BF16: the same pairs and order, converted."""

        native = False

    micro.micro_gemm_configs[CppMicroGemmBF16Dot] = micro.generate_gemm_config(
        VecAVX512VNNI, [TILE], input_dtype=torch.bfloat16, output_dtype=torch.float, extra_check=_takes)
    micro.micro_gemm_configs[CppMicroGemmBF16Pairs] = micro.generate_gemm_config(
        VecAVX512, [TILE], input_dtype=torch.bfloat16, output_dtype=torch.float, extra_check=_takes_converting)
    own = micro.micro_gemm_configs[micro.CppMicroGemmFP32Vec]
    for i, config in enumerate(own):
        if (config.vec_isa_cls is VecAVX512 and config.input_dtype == torch.bfloat16
                and config.input2_dtype == torch.bfloat16):
            own[i] = dataclasses.replace(config, extra_check=_unless_converting_takes(config.extra_check))
    return True
