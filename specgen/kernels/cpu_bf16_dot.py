"""A bf16 GEMM micro-kernel for Inductor's C++ template on CPUs with AVX512-BF16 and no AMX; its reference.

Contract: `register_bf16_dot_kernel()` (idempotent) adds `CppMicroGemmBF16Dot` to Inductor's registry
of CPU micro-kernels. For every GEMM of bf16 activations and bf16 weights (fp32 accumulation) that the
C++ template compiles on such a CPU (AMD Zen 4 and later, Intel Cooper Lake), with an even K, it
is the kernel taken, whatever the number of rows M: it is the only bf16 kernel of its ISA class,
which Inductor ranks above the plain AVX-512 one, and its check reads only K, the CPU and alpha.
Each output element is the fp32 sum `dot_pairs_reference` computes: for k = 0, 2, 4, ... in
order, acc += a[k+1] * b[k+1], then acc += a[k] * b[k] (the order `vdpbf16ps` specifies; bf16
products are exact in fp32, denormals flushed). That depends on the row alone, never on how many
rows share the GEMM, so a token verified beside drafts gets the bits plain decoding gives it.

Why: without AMX, Inductor's bf16 GEMM converts both operands to fp32 and multiplies with fp32 FMAs
(`CppMicroGemmFP32Vec`), which leaves the CPU's bf16 dot-product instruction unused: at 16 rows and
more a step's GEMMs are compute-bound, and a speculative step of 2 rows per slot cost about twice a
plain one at 8 and 16 slots. `vdpbf16ps` does two multiply-adds per fp32 lane where an FMA does one,
and reads the weight in bf16 with no conversion. SmolLM2's 3072 x 576 GEMM on 2 AMD EPYC Zen 4
cores, `python benchmarks/gemm_rows.py --rows 1 4 8 16 32` against `--no-bf16-dot` (Inductor's
kernel): 109 / 118 / 153 / 238 / 378 us against 135 / 181 / 264 / 410 / 734.

Layout: the template packs the frozen weight in blocks of `block_n` columns, each in VNNI2 order
(for each pair of k, the columns' two values side by side: one 512-bit load holds 16 columns' pairs);
a weight that is not a constant is packed the same way inside the kernel (`pack_vnni_B_locally`).
The register tile is 4 rows x 48 columns (12 accumulators): on Zen 4, 4 x 48, 6 x 48 and 8 x 32
ran alike from 8 rows on, 4 x 64 was slow at 4 rows.
"""

from __future__ import annotations

import functools

import torch

TILE = (4, 48, 2)     # rows, columns (a multiple of 16), k per step (a bf16 pair)

_KERNEL = r"""
#include <cstring>
#include <immintrin.h>

// One register tile: C[BM, 16 * NV] (+)= A[BM, K] @ B, B in VNNI2 order (pair row k / 2 at B + k * ldb).
template <int64_t BM, int64_t NV, bool accum>
__attribute__((target("avx512f,avx512bw,avx512bf16"), noinline))
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


def supported(vec_isa=None) -> bool:
    """Whether this CPU and compiler take the kernel: AVX512-BF16 code builds and runs, no AMX (where
    AMX is, Inductor's AMX kernel is left to do bf16)."""
    from torch._inductor.cpu_vec_isa import VecAMX, VecAVX512VNNI, pick_vec_isa

    isa = vec_isa if vec_isa is not None else pick_vec_isa()
    return (isinstance(isa, VecAVX512VNNI) and not isinstance(isa, VecAMX)
            and isa.is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported())


def _takes(config, m, n, k, alpha, num_threads, **kwargs) -> bool:
    # Never the rows (m): one kernel for a GEMM whatever its rows, so a row's bits never depend on them.
    return k % 2 == 0 and alpha == 1 and supported(kwargs.get("vec_isa"))


@functools.cache
def register_bf16_dot_kernel() -> bool:
    """Add the kernel to Inductor's registry (once). False where Inductor's registry is not as
    expected: then Inductor's own kernels stand."""
    import torch._inductor.lowering  # noqa: F401  (the codegen modules import in this order)
    from torch._inductor.codegen import cpp_micro_gemm as micro
    from torch._inductor.codegen.common import KernelTemplate
    from torch._inductor.cpu_vec_isa import VecAVX512VNNI

    needed = ("micro_gemm_configs", "CppMicroGemm", "generate_gemm_config", "LayoutType")
    if not all(hasattr(micro, name) for name in needed):
        return False

    class CppMicroGemmBF16Dot(micro.CppMicroGemm):
        """bf16 x bf16 -> fp32 with `vdpbf16ps` (this module's contract)."""

        def codegen_define(self, kernel) -> str:
            options = {"declare_kernel": self.get_kernel_declaration(), "kernel": kernel,
                       "block_m": self.register_blocking.block_m, "block_n": self.register_blocking.block_n,
                       **self.get_common_options()}
            return KernelTemplate._template_from_string(_KERNEL).render(options)

        def get_b_layout(self):
            return micro.LayoutType.VNNI2

    micro.micro_gemm_configs[CppMicroGemmBF16Dot] = micro.generate_gemm_config(
        VecAVX512VNNI, [TILE], input_dtype=torch.bfloat16, output_dtype=torch.float, extra_check=_takes)
    return True
