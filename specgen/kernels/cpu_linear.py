"""Row-invariant matrix products for eager CPU steps: a C++ kernel, built by Inductor's toolchain; its reference.

Contract: `linear(x, weight, bias=None, out_dtype=None)` takes
  x        [..., G, K] or [..., K]   float32, bfloat16 or float16; any leading dims are rows
  weight   [G, N, K] or [N, K]       float32, bfloat16 or float16, each group's [N, K] contiguous
  bias     [N] | None                added in float32 before the output is rounded
and returns x @ weight^T per group, [..., G, N] (or [..., N]) in `out_dtype` (default x's dtype).
Every output element is one float32 sum whose order depends on K and the CPU's vector width alone:
lane l of a vector accumulator takes the products of k = l, l + W, l + 2W, ... by fused multiply-add
(the last, partial vector zero-filled), and the W lanes are then summed by the machine's fixed tree.
So a row's result is the same bits whatever other rows share the call (M), where it sits among them,
and how many threads run it (threads split the outputs, never a sum). `linear_reference` is the
same products in float64, the oracle the tests hold the kernel to (within float32 rounding); the
bits-level promise is tested directly (rows alone against rows together, one thread against two).

Why: an eager step's GEMMs go through MKL (float32) or oneDNN (bf16), which pick their kernels and
so the order of a row's sums by the number of rows: on an AMD EPYC Zen 4 float32 rows came out one
way alone, another beside 1-2 rows, a third beside 3 or more, and bf16 on AMX Xeons differed with
the rows and the thread count. Plain decoding multiplies one row per slot and a speculative step
K + 1, so a verified token's logits were not plain decoding's: greedy and seeded output parted
from plain decoding's near ties. Compiled steps have Inductor's C++ template for this
(pipelines/cpu_gemm.py); eager steps (short jobs, `compile: false`) have this kernel. A step's
GEMMs have few rows (slots x (k + 1)) and read every weight once: the kernel streams each weight
row once for all the rows of the call (memory-bound, like a GEMV), which costs what MKL's GEMV does at
one row. A prefill (many rows, compute-bound) keeps the BLAS: its rows are made invariant by
always prefilling a prompt alone (pipelines/prefill.py).

Grouped products (G > 1, weight [G, N, K]) are MLA's per-head up-projections (models/mla.py).
"""

from __future__ import annotations

import functools

import torch

_CTYPE = {torch.float32: "float", torch.bfloat16: "at::BFloat16", torch.float16: "at::Half"}

# Register tile: RM rows of x by RN weight rows (outputs), RM * RN vector accumulators.
RM, RN = 4, 4

_SOURCE = r"""#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <vector>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t RM = {{RM}};
constexpr int64_t RN = {{RN}};
typedef {{XT}} XT;
typedef {{WT}} WT;
typedef {{OT}} OT;

template <typename T> static inline Vec load_w(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec v;
    at::vec::load_to_float<T>(p, v);
    return v;
  }
}

static inline float hsum(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// C[MR, NR] = xf[MR rows, KP] . w[NR rows, K]: lane l of each accumulator sums k = l, l + W, ... by
// FMA (wt: each weight row's last, partial vector, zero-filled), then the lanes by the fixed tree
template <int64_t MR, int64_t NR>
static inline void tile(const float* xf, int64_t KP, const WT* w, int64_t K, const float* wt,
                        float* res) {
  Vec acc[MR][NR];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < NR; ++j) acc[i][j] = Vec(0.f);
  const int64_t KV = K / W;
  for (int64_t v = 0; v < KV; ++v) {
    Vec wv[NR];
    for (int64_t j = 0; j < NR; ++j) wv[j] = load_w(w + j * K + v * W);
    for (int64_t i = 0; i < MR; ++i) {
      const Vec xv = Vec::loadu(xf + i * KP + v * W);
      for (int64_t j = 0; j < NR; ++j) acc[i][j] = at::vec::fmadd(xv, wv[j], acc[i][j]);
    }
  }
  if (K % W) {
    for (int64_t i = 0; i < MR; ++i) {
      const Vec xv = Vec::loadu(xf + i * KP + KV * W);
      for (int64_t j = 0; j < NR; ++j) acc[i][j] = at::vec::fmadd(xv, Vec::loadu(wt + j * W), acc[i][j]);
    }
  }
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t j = 0; j < NR; ++j) res[i * RN + j] = hsum(acc[i][j]);
}

template <int64_t MR>
static inline void row_tile(int64_t nr, const float* xf, int64_t KP, const WT* w, int64_t K,
                            const float* wt, float* res) {
  switch (nr) {
    case 4: tile<MR, 4>(xf, KP, w, K, wt, res); break;
    case 3: tile<MR, 3>(xf, KP, w, K, wt, res); break;
    case 2: tile<MR, 2>(xf, KP, w, K, wt, res); break;
    default: tile<MR, 1>(xf, KP, w, K, wt, res);
  }
}

// x: M rows of G groups of K (row stride sx, group stride sg); w: G groups (stride swg) of N rows
// of K (contiguous); out: [M, G, N]
extern "C" void kernel(const XT* x, const WT* w, const float* bias, OT* out, int64_t M, int64_t G,
                       int64_t N, int64_t K, int64_t sx, int64_t sg, int64_t swg, int64_t has_bias) {
  const int64_t KP = (K + W - 1) / W * W;
  std::vector<float> xf(M * G * KP);
  #pragma omp parallel for
  for (int64_t r = 0; r < M * G; ++r) {
    const XT* src = x + (r / G) * sx + (r % G) * sg;
    float* dst = xf.data() + r * KP;
    for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<float>(src[k]);
    for (int64_t k = K; k < KP; ++k) dst[k] = 0.f;
  }
  const int64_t NB = (N + RN - 1) / RN;
  #pragma omp parallel for schedule(static)
  for (int64_t gb = 0; gb < G * NB; ++gb) {
    const int64_t g = gb / NB, n0 = (gb % NB) * RN, nr = std::min(RN, N - n0);
    const WT* wg = w + g * swg + n0 * K;
    alignas(64) float wt[RN * W];
    const int64_t K0 = K / W * W;
    for (int64_t j = 0; j < nr; ++j)
      for (int64_t l = 0; l < W; ++l) wt[j * W + l] = K0 + l < K ? static_cast<float>(wg[j * K + K0 + l]) : 0.f;
    alignas(64) float res[RM * RN];
    for (int64_t m0 = 0; m0 < M; m0 += RM) {
      const float* xr = xf.data() + (m0 * G + g) * KP;
      const int64_t mr = std::min(RM, M - m0);
      // rows m0 .. m0 + mr of group g sit G * KP floats apart: the tile reads them through KP' = G * KP
      switch (mr) {
        case 4: row_tile<4>(nr, xr, G * KP, wg, K, wt, res); break;
        case 3: row_tile<3>(nr, xr, G * KP, wg, K, wt, res); break;
        case 2: row_tile<2>(nr, xr, G * KP, wg, K, wt, res); break;
        default: row_tile<1>(nr, xr, G * KP, wg, K, wt, res);
      }
      for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nr; ++j) {
          const float b = has_bias ? bias[n0 + j] : 0.f;
          out[((m0 + i) * G + g) * N + n0 + j] = static_cast<OT>(res[i * RN + j] + b);
        }
    }
  }
}
"""


@functools.cache
def _kernel(x_dtype: torch.dtype, w_dtype: torch.dtype, out_dtype: torch.dtype):
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    xt, wt, ot = _CTYPE[x_dtype], _CTYPE[w_dtype], _CTYPE[out_dtype]
    source = (_SOURCE.replace("{{RM}}", str(RM)).replace("{{RN}}", str(RN))
              .replace("{{XT}}", xt).replace("{{WT}}", wt).replace("{{OT}}", ot))
    argtypes = [f"const {xt}*", f"const {wt}*", "const float*", f"{ot}*",
                "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t"]
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)


_NO_BIAS = torch.zeros(1)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes these operands (else the caller keeps `F.linear`)."""
    # a weight's rows are contiguous (a group's N rows one after another; groups at any stride)
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype in _CTYPE
            and weight.dtype in _CTYPE and weight.dim() in (2, 3) and weight.stride(-1) == 1
            and weight.stride(-2) == weight.shape[-1] and x.shape[-1] == weight.shape[-1]
            and (weight.dim() == 2 or x.dim() >= 2 and x.shape[-2] == weight.shape[0]))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    # x: [..., K] with weight [N, K]  -> [..., N];  x: [..., G, K] with weight [G, N, K] -> [..., G, N]
    grouped = weight.dim() == 3
    G, N, K = (weight.shape if grouped else (1, *weight.shape))
    lead = x.shape[:-2] if grouped else x.shape[:-1]
    rows = x.reshape(-1, G, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    out = torch.empty(M, G, N, dtype=out_dtype or x.dtype)
    b = bias.float().contiguous() if bias is not None else _NO_BIAS
    _kernel(x.dtype, weight.dtype, out.dtype)(rows, weight, b, out, M, G, N, K, rows.stride(0), rows.stride(1),
                                              weight.stride(0) if grouped else 0, int(bias is not None))
    return out.view(*lead, G, N) if grouped else out.view(*lead, N)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same products in float64 (the exact products, summed with 53 bits): `linear`'s oracle."""
    # x, weight as in `linear` -> float64
    if weight.dim() == 3:
        out = torch.einsum("...gk,gnk->...gn", x.double(), weight.double())
    else:
        out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out
