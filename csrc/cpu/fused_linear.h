// fused_linear on raw pointers (no torch): the projections of a decoder layer, each weight read once
// per call for all the rows of the pass, with the epilogue applied to each finished tile.
//   kStore   out_i = A W_i^T + b_i        for every weight i (q, k, v: one call, one pass over the rows)
//   kAdd     out_i += A W_i^T + b_i       (the residual stream after o_proj and down_proj)
//   kSwiGLU  out = silu(A Wg^T + bg) * (A Wu^T + bu)   (gate and up read side by side)
// The output tiles of all the weights form one index space [0, fused_linear_num_tiles) that the
// caller splits between threads.
#pragma once
#include <cstdint>

#include "simd/lanes4.h"
#include "small_gemm.h"
#include "vector_math.h"

namespace specdec::cpu {

enum class LinearEpilogue { kStore = 0, kAdd = 1, kSwiGLU = 2 };

struct LinearOutput {
  float* data;        // [M, ld]
  int64_t ld;
  const float* bias;  // [N] fp32 or null
};

inline int64_t fused_linear_num_tiles(LinearEpilogue epilogue, const GemmWeight* weights, int count) {
  if (epilogue == LinearEpilogue::kSwiGLU) return num_tiles(weights[0].rows);
  int64_t total = 0;
  for (int i = 0; i < count; ++i) total += num_tiles(weights[i].rows);
  return total;
}

inline float bias_at(const LinearOutput& out, int64_t n) { return out.bias != nullptr ? out.bias[n] : 0.0f; }

// The epilogue of a block's outputs (features n0 .. n0 + nt - 1 of rows m0 .. m0 + mb - 1, row m's sums at
// parts + m * ld): the sums plus the bias, stored or added.
template <bool kAdd, bool kBias>
inline void store_rows(const LinearOutput& o, int64_t m0, int mb, int64_t n0, int nt, const float* parts, int64_t ld) {
  for (int m = 0; m < mb; ++m) {
    float* dst = o.data + (m0 + m) * o.ld + n0;
    const float* src = parts + m * ld;
    for (int j = 0; j < nt; ++j) {
      float v = src[j];
      if constexpr (kBias) v += o.bias[n0 + j];
      if constexpr (kAdd) {
        dst[j] += v;
      } else {
        dst[j] = v;
      }
    }
  }
}

template <bool kAdd, bool kBias>
inline void linear_tiles(Isa isa, const GemmActivations& a, int64_t M, const GemmWeight& w, const LinearOutput& o,
                         int64_t begin, int64_t end, bool weights_cached) {
  gemm_tiles(isa, a, M, &w, 1, begin, end, weights_cached,
             [&](int64_t m0, int mb, int64_t n0, int nt, const float* const* parts, int64_t ld) {
               store_rows<kAdd, kBias>(o, m0, mb, n0, nt, parts[0], ld);
             });
}

// Output tiles [begin, end) of the index space above. weights_cached: see gemm_tiles.
inline void fused_linear_range(Isa isa, const GemmActivations& a, int64_t M, LinearEpilogue epilogue,
                               const GemmWeight* weights, const LinearOutput* outs, int count, int64_t begin,
                               int64_t end, bool weights_cached = false) {
  if (epilogue == LinearEpilogue::kSwiGLU) {
    const LinearOutput& gate = outs[0];
    const LinearOutput& up = outs[1];
    float* out = outs[0].data;
    const int64_t ldo = outs[0].ld;
    gemm_tiles(isa, a, M, weights, 2, begin, end, weights_cached,
               [&](int64_t m0, int mb, int64_t n0, int nt, const float* const* parts, int64_t ld) {
                 for (int m = 0; m < mb; ++m) {
                   float* dst = out + (m0 + m) * ldo + n0;
                   const float* g = parts[0] + m * ld;
                   const float* u = parts[1] + m * ld;
                   int j = 0;
                   for (; j + 4 <= nt; j += 4)
                     swiglu4(g + j, gate.bias != nullptr ? gate.bias + n0 + j : nullptr, u + j,
                             up.bias != nullptr ? up.bias + n0 + j : nullptr, dst + j);
                   for (; j < nt; ++j) dst[j] = silu(g[j] + bias_at(gate, n0 + j)) * (u[j] + bias_at(up, n0 + j));
                 }
               });
    return;
  }
  int64_t first = 0;  // first global tile of weight i
  for (int i = 0; i < count && first < end; ++i) {
    const int64_t tiles_i = num_tiles(weights[i].rows);
    const int64_t lo = begin > first ? begin - first : 0;
    const int64_t hi = end - first < tiles_i ? end - first : tiles_i;
    if (lo < hi) {
      const LinearOutput& o = outs[i];
      const bool add = epilogue == LinearEpilogue::kAdd, bias = o.bias != nullptr;
      if (add && bias) linear_tiles<true, true>(isa, a, M, weights[i], o, lo, hi, weights_cached);
      if (add && !bias) linear_tiles<true, false>(isa, a, M, weights[i], o, lo, hi, weights_cached);
      if (!add && bias) linear_tiles<false, true>(isa, a, M, weights[i], o, lo, hi, weights_cached);
      if (!add && !bias) linear_tiles<false, false>(isa, a, M, weights[i], o, lo, hi, weights_cached);
    }
    first += tiles_i;
  }
}

}  // namespace specdec::cpu
