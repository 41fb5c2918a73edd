// fused_linear on raw pointers (no torch): the projections of a decoder layer, each weight read once
// per call for all the rows of the pass, with the epilogue applied to each finished tile.
//   kStore   out_i = A W_i^T + b_i        for every weight i (q, k, v: one call, one pass over the rows)
//   kAdd     out_i += A W_i^T + b_i       (the residual stream after o_proj and down_proj)
//   kSwiGLU  out = silu(A Wg^T + bg) * (A Wu^T + bu)   (gate and up read side by side)
// The output tiles of all the weights form one index space [0, fused_linear_num_tiles) that the
// caller splits between threads.
#pragma once
#include <cstdint>

#include "isa_target.h"
#include "small_gemm.h"
#include "vector_math.h"

#if SPECDEC_HAVE_X86_PATHS
#include <emmintrin.h>
#endif

namespace specdec::cpu {

enum class LinearEpilogue { kStore = 0, kAdd = 1, kSwiGLU = 2 };

struct LinearOutput {
  float* data;        // [M, ld]
  int64_t ld;
  const float* bias;  // [N] fp32 or null
};

// silu(g) = g * sigmoid(g), sigmoid through exp(-|g|) <= 1 so that nothing overflows.
inline float silu(float g) {
  const float e = exp_nonpositive(g >= 0.0f ? -g : g);
  const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return g * sigmoid;
}

#if SPECDEC_HAVE_X86_PATHS
// silu and exp_nonpositive in four SSE2 lanes (the x86-64 baseline, so on every path): the same
// operations in the same order, no fused multiply-add, so each lane gives the scalar functions' bits.
// The scalar epilogue did not vectorise and took a tenth of a verification pass (perf, 9 rows).
inline __m128 exp4_nonpositive(__m128 x) {
  const __m128 min_arg = _mm_set1_ps(-87.3f);
  const __m128 round_magic = _mm_set1_ps(12582912.0f);
  const __m128 xc = _mm_max_ps(x, min_arg);  // NaN -> min_arg (max_ps returns its second operand)
  const __m128 n = _mm_sub_ps(_mm_add_ps(_mm_mul_ps(xc, _mm_set1_ps(1.44269504088896341f)), round_magic), round_magic);
  const __m128 r = _mm_sub_ps(_mm_sub_ps(xc, _mm_mul_ps(n, _mm_set1_ps(0.693359375f))),
                              _mm_mul_ps(n, _mm_set1_ps(-2.12194440e-4f)));
  __m128 poly = _mm_set1_ps(1.9875691500e-4f);
  poly = _mm_add_ps(_mm_mul_ps(poly, r), _mm_set1_ps(1.3981999507e-3f));
  poly = _mm_add_ps(_mm_mul_ps(poly, r), _mm_set1_ps(8.3334519073e-3f));
  poly = _mm_add_ps(_mm_mul_ps(poly, r), _mm_set1_ps(4.1665795894e-2f));
  poly = _mm_add_ps(_mm_mul_ps(poly, r), _mm_set1_ps(1.6666665459e-1f));
  poly = _mm_add_ps(_mm_mul_ps(poly, r), _mm_set1_ps(5.0000001201e-1f));
  const __m128 expm = _mm_add_ps(_mm_add_ps(_mm_mul_ps(_mm_mul_ps(poly, r), r), r), _mm_set1_ps(1.0f));
  const __m128i exponent = _mm_slli_epi32(_mm_add_epi32(_mm_cvttps_epi32(n), _mm_set1_epi32(127)), 23);
  const __m128 result = _mm_mul_ps(expm, _mm_castsi128_ps(exponent));
  return _mm_and_ps(_mm_cmpge_ps(x, min_arg), result);
}

// dst[j] = silu(g[j]) * u[j] for j < 4, as silu(g) * u computes it.
inline void swiglu4(__m128 g, __m128 u, float* dst) {
  const __m128 nonnegative = _mm_cmpge_ps(g, _mm_setzero_ps());  // false for NaN, as g >= 0.0f
  const __m128 negated = _mm_xor_ps(g, _mm_set1_ps(-0.0f));
  const __m128 e = exp4_nonpositive(_mm_or_ps(_mm_and_ps(nonnegative, negated), _mm_andnot_ps(nonnegative, g)));
  const __m128 numerator = _mm_or_ps(_mm_and_ps(nonnegative, _mm_set1_ps(1.0f)), _mm_andnot_ps(nonnegative, e));
  const __m128 sigmoid = _mm_div_ps(numerator, _mm_add_ps(_mm_set1_ps(1.0f), e));
  _mm_storeu_ps(dst, _mm_mul_ps(_mm_mul_ps(g, sigmoid), u));
}
#endif

inline int64_t fused_linear_num_tiles(LinearEpilogue epilogue, const GemmWeight* weights, int count) {
  if (epilogue == LinearEpilogue::kSwiGLU) return num_tiles(weights[0].rows);
  int64_t total = 0;
  for (int i = 0; i < count; ++i) total += num_tiles(weights[i].rows);
  return total;
}

inline float bias_at(const LinearOutput& out, int64_t n) { return out.bias != nullptr ? out.bias[n] : 0.0f; }

// The epilogue of one output: the dot product plus the bias, stored or added.
template <bool kAdd, bool kBias>
inline void store_rows(const LinearOutput& o, int64_t m0, int mb, int64_t n0, int nt, const float* tile) {
  for (int m = 0; m < mb; ++m) {
    float* dst = o.data + (m0 + m) * o.ld + n0;
    const float* src = tile + m * kTileN;
    auto put = [&](int j) {
      float v = src[j];
      if constexpr (kBias) v += o.bias[n0 + j];
      if constexpr (kAdd) {
        dst[j] += v;
      } else {
        dst[j] = v;
      }
    };
    if (nt == kTileN) {  // a constant trip count in the common case: it vectorises
      for (int j = 0; j < kTileN; ++j) put(j);
    } else {
      for (int j = 0; j < nt; ++j) put(j);
    }
  }
}

template <bool kAdd, bool kBias>
inline void linear_tiles(Isa isa, const GemmActivations& a, int64_t M, const GemmWeight& w, const LinearOutput& o,
                         int64_t begin, int64_t end, bool weights_cached) {
  gemm_tiles(isa, a, M, &w, 1, begin, end, weights_cached,
             [&](int64_t m0, int mb, int64_t n0, int nt, const float* const* tiles) {
               store_rows<kAdd, kBias>(o, m0, mb, n0, nt, tiles[0]);
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
    const int64_t ld = outs[0].ld;
    gemm_tiles(isa, a, M, weights, 2, begin, end, weights_cached,
               [&](int64_t m0, int mb, int64_t n0, int nt, const float* const* tiles) {
                 for (int m = 0; m < mb; ++m) {
                   float* dst = out + (m0 + m) * ld + n0;
                   auto put = [&](int j) {
                     const float g = tiles[0][m * kTileN + j] + bias_at(gate, n0 + j);
                     const float u = tiles[1][m * kTileN + j] + bias_at(up, n0 + j);
                     dst[j] = silu(g) * u;
                   };
                   if (nt == kTileN) {
#if SPECDEC_HAVE_X86_PATHS
                     static_assert(kTileN == 4, "swiglu4 takes a tile's four outputs");
                     const __m128 zero = _mm_setzero_ps();
                     const __m128 bg = gate.bias != nullptr ? _mm_loadu_ps(gate.bias + n0) : zero;
                     const __m128 bu = up.bias != nullptr ? _mm_loadu_ps(up.bias + n0) : zero;
                     swiglu4(_mm_add_ps(_mm_loadu_ps(tiles[0] + m * kTileN), bg),
                             _mm_add_ps(_mm_loadu_ps(tiles[1] + m * kTileN), bu), dst);
#else
                     for (int j = 0; j < kTileN; ++j) put(j);
#endif
                   } else {
                     for (int j = 0; j < nt; ++j) put(j);
                   }
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
