// The AVX2 + FMA small-M GEMM tile: 8 fp32 lanes, weights widened to fp32 as they are loaded
// (bf16 by a shift, fp16 by F16C), a block of 2 rows x 4 output features in 8 accumulators (the
// 16 ymm registers hold them, the 4 weight vectors and one activation vector). Activations in fp32
// (rounded to bf16 beforehand when the products are bf16 x bf16: those products are exact in fp32).
#pragma once
#include <cstdint>

#include "gemm_types.h"
#include "isa_target.h"

#if SPECDEC_HAVE_X86_PATHS
#include <immintrin.h>

SPECDEC_BEGIN_TARGET_AVX2
namespace specdec::cpu::avx2 {

static_assert(kTileN == 4, "the reductions below produce four outputs at a time");
constexpr int kTileM = 2;

template <DType kW>
inline __m256 load8(const void* w, int64_t k) {
  if constexpr (kW == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(w) + k);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + k));
    if constexpr (kW == DType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// The last n < 8 elements from k, zero-filled (copied to a buffer: no read past the row).
template <DType kW>
inline __m256 load8_tail(const void* w, int64_t k, int n) {
  alignas(32) float buffer[8] = {};
  for (int i = 0; i < n; ++i) buffer[i] = load_as_float<kW>(w, k + i);
  return _mm256_load_ps(buffer);
}

// The sums of four accumulators' 8 lanes, each associated exactly as fold_sum<8> (lane l += lane
// l + 4, then + 2, + 1), four at a time.
inline __m128 reduce8x4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 u23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  // low 128 bits: accumulators 0 and 2 after the + 2 level (2 lanes each); high: 1 and 3
  const __m256 v = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 w = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm256_castps256_ps128(_mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 2, 6, 0, 0, 0, 0)));
}

template <DType kW, int MB>
inline void tile_fixed(const GemmActivations& a, int64_t m0, const GemmWeight& w, int64_t n0, int nt, float* out) {
  const void* rows[kTileN];
  for (int j = 0; j < kTileN; ++j) rows[j] = w.row(n0 + (j < nt ? j : nt - 1));  // spare lanes repeat a row
  const float* act[MB];
  for (int m = 0; m < MB; ++m) act[m] = a.f32 + (m0 + m) * a.ld_f32;
  __m256 acc[MB][kTileN];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < kTileN; ++j) acc[m][j] = _mm256_setzero_ps();
  const int64_t K = w.cols;
  const int64_t bytes = kW == DType::kF32 ? 4 : 2;
  const int64_t ahead = prefetch_rows_ahead(w.ld, bytes) * w.ld * bytes;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[kTileN];
    for (int j = 0; j < kTileN; ++j) wv[j] = load8<kW>(rows[j], k);
    for (int j = 0; j < kTileN; ++j)
      prefetch_weights(static_cast<const char*>(rows[j]) + k * bytes + ahead);
    for (int m = 0; m < MB; ++m) {
      const __m256 av = _mm256_loadu_ps(act[m] + k);
      for (int j = 0; j < kTileN; ++j) acc[m][j] = _mm256_fmadd_ps(av, wv[j], acc[m][j]);
    }
  }
  if (k < K) {
    const int n = static_cast<int>(K - k);
    __m256 wv[kTileN];
    for (int j = 0; j < kTileN; ++j) wv[j] = load8_tail<kW>(rows[j], k, n);
    for (int m = 0; m < MB; ++m) {
      const __m256 av = load8_tail<DType::kF32>(act[m], k, n);
      for (int j = 0; j < kTileN; ++j) acc[m][j] = _mm256_fmadd_ps(av, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm_storeu_ps(out + m * kTileN, reduce8x4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

template <DType kW>
inline void tile_typed(const GemmActivations& a, int64_t m0, int mb, const GemmWeight& w, int64_t n0, int nt,
                       float* out) {
  if (mb == 2) return tile_fixed<kW, 2>(a, m0, w, n0, nt, out);
  return tile_fixed<kW, 1>(a, m0, w, n0, nt, out);
}

// out[m * kTileN + j] = sum_k a.f32[m0 + m, k] * w[n0 + j, k] for m < mb <= kTileM, j < nt <= kTileN.
inline void gemm_tile(const GemmActivations& a, int64_t m0, int mb, const GemmWeight& w, int64_t n0, int nt,
                      float* out) {
  with_dtype(w.type, [&](auto type) { tile_typed<decltype(type)::value>(a, m0, mb, w, n0, nt, out); });
}

}  // namespace specdec::cpu::avx2
SPECDEC_END_TARGET
#endif
