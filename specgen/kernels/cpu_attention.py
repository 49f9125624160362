"""Row-invariant decode attention for CPU steps (compiled and eager): a C++ kernel, built by Inductor's toolchain.

Contract: `decode_attention(q, k_cache, v_cache, positions, key_index, scale)` (also the opaque op
`specgen::cpu_decode_attention`, which the compiled step calls as one extern node) takes
  q          [B, T, Hq, D]        float32, bfloat16 or float16
  k_cache    [S, Hkv, L, D]       contiguous, S >= B: batch row b reads slot b; v_cache alike
  positions  [B, T] int64         absolute position of each query
  key_index  [kv_len]             only its length counts: no key at or past kv_len is read
and returns [B, T, Hq, D] in q's dtype: query (b, t, h) attends to the keys 0 .. min(positions[b, t],
kv_len - 1) of KV head h // (Hq / Hkv), softmax(q.k * scale) weighted values, in float32 throughout
(the contract of `attention.attention_reference` with `row_invariant`, which tests compare it with).

Row invariance, what it is for: a query's output depends on its own query, position and keys
alone, never on how many query rows (T, drafts) or cache positions (kv_len beyond its own) share
the call, bit for bit. So the token a speculative step verifies beside its drafts comes out as the
plain step computes it. Every sum has a fixed order that only the row's own length decides:
- a score is one multiply-add chain over d = 0 .. D-1;
- keys are split in chunks of CHUNK positions from 0 (a constant), each chunk's softmax partial
  (max, sum of exp, exp-weighted values summed in key order) computed alone, and the chunks merged
  in order (a row of one chunk: scaled by exp(0) = 1, exact);
- tile shapes and threads change which rows or keys are computed together, never the order of one
  row's sums (the vector width, which shapes the exp-sum's lanes, is the machine's, as for every
  compiled kernel: plain and speculative jobs on one machine run the same binary).

Why a kernel: Inductor compiled the same contract written as broadcast sums into loops over each
(query row, key) pair: each key re-read and converted per query row, a horizontal vector sum per
score, the query's rotary recomputed per key. Its cost grew with every row verified: SmolLM2, bf16,
one slot, 1,216 cached positions, 2 AMD EPYC Zen 4 cores, one layer's attention compiled alone:
117 us a call for 1 row per slot and 268 us for 3 (verify of K = 2; some 27 us of each are the
compiled call itself). This kernel converts each key and value once for all the query rows of its
KV head (GQA), transposes the keys of a chunk so a score is a vertical chain (no horizontal sum),
computes 4 query rows x 2 vectors of keys per register tile, and spreads (slot, KV head, chunk)
over the threads: 62 and 114 us a call there. Built once per (dtypes, D) on first use, by Inductor's
C++ toolchain and flags (its cache, the CPU's vector ISA), so it needs nothing a compiled CPU step
does not already need.
"""

from __future__ import annotations

import functools

import torch

CHUNK = 128           # keys per work item and per softmax partial: part of every row's sum order

_CTYPE = {torch.float32: "float", torch.bfloat16: "at::BFloat16", torch.float16: "at::Half"}

_SOURCE = r"""#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <limits>
#include <vector>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t D = {{D}};
constexpr int64_t W = Vec::size();
constexpr int64_t DP = (D + W - 1) / W * W;
constexpr int64_t DV = DP / W;
constexpr int64_t DB = DV % 4 == 0 ? 4 : (DV % 2 == 0 ? 2 : 1);
constexpr int64_t CHUNK = {{CHUNK}};
constexpr int64_t PS = DP + 2;
typedef {{QT}} QT;
typedef {{KT}} KT;
static const float NEG_INF = -std::numeric_limits<float>::infinity();

static inline float hsum(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v); }
static inline float hmax(Vec v) { return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, v); }

template <typename T> static inline void row_to_float(const T* src, float* dst) {
  if constexpr (D % W == 0 && std::is_same_v<T, float>) {
    for (int64_t i = 0; i < DV; ++i) Vec::loadu(src + i * W).store(dst + i * W);
  } else if constexpr (D % W == 0) {
    for (int64_t i = 0; i < DV; ++i) { Vec v; at::vec::load_to_float<T>(src + i * W, v); v.store(dst + i * W); }
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]);
    for (int64_t d = D; d < DP; ++d) dst[d] = 0.f;
  }
}

// scores of RT query rows (qf, row stride DP) against NB * W keys from column jb of kt ([DP][CHUNK]):
// each score is one multiply-add chain over d = 0 .. D-1, in order, whatever RT, NB or the tile
template <int RT, int NB>
static inline void score_block(const float* qf, const float* kt, int64_t jb, float* sc, float scale) {
  Vec acc[RT][NB];
  for (int b = 0; b < NB; ++b) {
    const Vec k = Vec::loadu(kt + jb + b * W);
    for (int r = 0; r < RT; ++r) acc[r][b] = Vec(qf[r * DP]) * k;
  }
  for (int64_t d = 1; d < D; ++d) {
    Vec k[NB];
    for (int b = 0; b < NB; ++b) k[b] = Vec::loadu(kt + d * CHUNK + jb + b * W);
    for (int r = 0; r < RT; ++r) {
      const Vec qd(qf[r * DP + d]);
      for (int b = 0; b < NB; ++b) acc[r][b] = at::vec::fmadd(qd, k[b], acc[r][b]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int b = 0; b < NB; ++b) (acc[r][b] * Vec(scale)).store(sc + r * CHUNK + jb + b * W);
}

template <int RT>
static inline void scores_tile(const float* qf, const float* kt, int64_t cnt, float* sc, float scale) {
  int64_t jb = 0;
  for (; jb + 2 * W <= cnt; jb += 2 * W) score_block<RT, 2>(qf, kt, jb, sc, scale);
  for (; jb < cnt; jb += W) score_block<RT, 1>(qf, kt, jb, sc, scale);
}

// weighted values of RT rows over keys 0 .. cnt-1 of vf ([CHUNK][DP]), in key order
template <int RT>
static inline void values_tile(const float* e, const float* vf, int64_t cnt, float* acc_out) {
  for (int64_t db = 0; db < DV; db += DB) {
    Vec acc[RT][DB];
    for (int r = 0; r < RT; ++r)
      for (int i = 0; i < DB; ++i) acc[r][i] = Vec(0.f);
    for (int64_t j = 0; j < cnt; ++j) {
      Vec v[DB];
      for (int i = 0; i < DB; ++i) v[i] = Vec::loadu(vf + j * DP + (db + i) * W);
      for (int r = 0; r < RT; ++r) {
        const Vec p(e[r * CHUNK + j]);
        for (int i = 0; i < DB; ++i) acc[r][i] = at::vec::fmadd(p, v[i], acc[r][i]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int i = 0; i < DB; ++i) acc[r][i].store(acc_out + r * PS + (db + i) * W);
  }
}

extern "C" void kernel(const QT* q, const KT* kc, const KT* vc, const int64_t* pos, QT* out,
                       int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Lmax, int64_t kv_len, float scale) {
  const int64_t G = Hq / Hkv, M = T * G;
  const int64_t C = (kv_len + CHUNK - 1) / CHUNK;
  // per (slot, KV head, chunk, query row): the weighted values (DP floats), then max and sum of exp;
  // the calling thread's own buffer, grown as needed (a step's call allocates nothing)
  thread_local std::vector<float> partials;
  partials.resize(std::max<size_t>(partials.size(), B * Hkv * C * M * PS));
  float* part = partials.data();
  // one parallel region (a fork costs about a microsecond): the chunks, a barrier, the merge
  #pragma omp parallel
  {
  #pragma omp for collapse(3) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b)
  for (int64_t h = 0; h < Hkv; ++h)
  for (int64_t c = 0; c < C; ++c) {
    thread_local std::vector<float> qf, kf, kt, vf, sc;
    const int64_t j0 = c * CHUNK;
    int64_t jend = j0;
    for (int64_t t = 0; t < T; ++t) jend = std::max(jend, std::min(std::min(pos[b * T + t] + 1, kv_len), j0 + CHUNK));
    if (jend <= j0) continue;
    const int64_t cnt_max = jend - j0, cnt_pad = (cnt_max + W - 1) / W * W;
    qf.resize(M * DP); kf.resize(CHUNK * DP); kt.resize(DP * CHUNK); vf.resize(CHUNK * DP); sc.resize(M * CHUNK);
    const KT* keys = kc + ((b * Hkv + h) * Lmax + j0) * D;
    const KT* values = vc + ((b * Hkv + h) * Lmax + j0) * D;
    for (int64_t j = 0; j < cnt_max; ++j) {
      row_to_float(keys + j * D, kf.data() + j * DP);
      row_to_float(values + j * D, vf.data() + j * DP);
    }
    at::vec::transpose_mxn<float>(kf.data(), DP, kt.data(), CHUNK, cnt_max, DP);
    for (int64_t d = 0; d < DP; ++d)
      for (int64_t j = cnt_max; j < cnt_pad; ++j) kt[d * CHUNK + j] = 0.f;
    float* pp = part + ((b * Hkv + h) * C + c) * M * PS;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t cnt = std::min(std::min(pos[b * T + t] + 1, kv_len), j0 + CHUNK) - j0;
      if (cnt <= 0) continue;
      const int64_t cp = (cnt + W - 1) / W * W;
      for (int64_t g = 0; g < G; ++g)
        row_to_float(q + ((b * T + t) * Hq + h * G + g) * D, qf.data() + (t * G + g) * DP);
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t m0 = t * G + g0;
        const float* qt = qf.data() + m0 * DP;
        float* st = sc.data() + m0 * CHUNK;
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: scores_tile<4>(qt, kt.data(), cnt, st, scale); break;
          case 3: scores_tile<3>(qt, kt.data(), cnt, st, scale); break;
          case 2: scores_tile<2>(qt, kt.data(), cnt, st, scale); break;
          default: scores_tile<1>(qt, kt.data(), cnt, st, scale);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = t * G + g;
        float* s = sc.data() + m * CHUNK;
        for (int64_t j = cnt; j < cp; ++j) s[j] = NEG_INF;
        Vec mx(NEG_INF);
        for (int64_t j = 0; j < cp; j += W) mx = at::vec::maximum(mx, Vec::loadu(s + j));
        const float mxs = hmax(mx);
        Vec tot(0.f);
        for (int64_t j = 0; j < cp; j += W) {
          const Vec e = (Vec::loadu(s + j) - Vec(mxs)).exp();
          e.store(s + j);
          tot = tot + e;
        }
        pp[m * PS + DP] = mxs;
        pp[m * PS + DP + 1] = hsum(tot);
      }
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t m0 = t * G + g0;
        const float* et = sc.data() + m0 * CHUNK;
        float* at = pp + m0 * PS;
        switch (std::min<int64_t>(4, G - g0)) {
          case 4: values_tile<4>(et, vf.data(), cnt, at); break;
          case 3: values_tile<3>(et, vf.data(), cnt, at); break;
          case 2: values_tile<2>(et, vf.data(), cnt, at); break;
          default: values_tile<1>(et, vf.data(), cnt, at);
        }
      }
    }
  }
  // merge each row's chunks in chunk order (exp(0) = 1 where there is one)
  #pragma omp for collapse(3)
  for (int64_t b = 0; b < B; ++b)
  for (int64_t t = 0; t < T; ++t)
  for (int64_t hq = 0; hq < Hq; ++hq) {
    const int64_t h = hq / G, m = t * G + hq % G;
    const int64_t n = std::min(pos[b * T + t] + 1, kv_len);
    const int64_t cm = (n + CHUNK - 1) / CHUNK;
    const float* pb = part + (b * Hkv + h) * C * M * PS + m * PS;
    float gmax = NEG_INF;
    for (int64_t c = 0; c < cm; ++c) gmax = std::max(gmax, pb[c * M * PS + DP]);
    float s = 0.f;
    Vec acc[DV];
    for (int64_t i = 0; i < DV; ++i) acc[i] = Vec(0.f);
    for (int64_t c = 0; c < cm; ++c) {
      const float* pc = pb + c * M * PS;
      const float w = std::exp(pc[DP] - gmax);
      s += pc[DP + 1] * w;
      for (int64_t i = 0; i < DV; ++i) acc[i] = at::vec::fmadd(Vec(w), Vec::loadu(pc + i * W), acc[i]);
    }
    alignas(64) float res[DP];
    const Vec inv(1.f / s);
    for (int64_t i = 0; i < DV; ++i) (acc[i] * inv).store(res + i * W);
    QT* dst = out + ((b * T + t) * Hq + hq) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<QT>(res[d]);
  }
  }
}
"""


@functools.cache
def _kernel(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int):
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    qt, kt = _CTYPE[q_dtype], _CTYPE[kv_dtype]
    source = (_SOURCE.replace("{{D}}", str(head_dim)).replace("{{CHUNK}}", str(CHUNK))
              .replace("{{QT}}", qt).replace("{{KT}}", kt))
    argtypes = [f"const {qt}*", f"const {kt}*", f"const {kt}*", "const int64_t*", f"{qt}*",
                "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "int64_t", "float"]
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `decode_attention` takes these inputs (else the caller keeps the PyTorch reference)."""
    return (q.device.type == "cpu" and q.dtype in _CTYPE and k_cache.dtype in _CTYPE
            and k_cache.shape[0] >= q.shape[0]
            and v_cache.dtype == k_cache.dtype and k_cache.shape == v_cache.shape
            and k_cache.shape[-1] == q.shape[-1] and q.shape[2] % k_cache.shape[1] == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                     key_index: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [B, T, Hq, D]; caches: [S, Hkv, L, D]; positions: [B, T]; key_index: [kv_len] -> [B, T, Hq, D]
    B, T, Hq, D = q.shape
    q, positions = q.contiguous(), positions.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    _kernel(q.dtype, k_cache.dtype, D)(q, k_cache, v_cache, positions, out, B, T, Hq, k_cache.shape[1],
                                       k_cache.shape[2], min(key_index.shape[0], k_cache.shape[2]), scale)
    return out


# The op is registered through torch.library's low-level API: a step calls it once per layer, and a
# `torch.library.custom_op` spent 16 us a call on its Python wrapping (2 AMD EPYC Zen 4 cores; the
# kernel itself, at a few dozen keys: 4 us), 0.5 ms of a 10 ms step; this dispatch costs ~2 us.
_LIBRARY = torch.library.Library("specgen", "FRAGMENT")
_LIBRARY.define("cpu_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor positions, "
                "Tensor key_index, float scale) -> Tensor")
_LIBRARY.impl("cpu_decode_attention", lambda *args: decode_attention(*args), "CPU")   # late-bound (tests)


@torch.library.register_fake("specgen::cpu_decode_attention", lib=_LIBRARY)
def _(q, k_cache, v_cache, positions, key_index, scale):
    return q.new_empty(q.shape)
