// The AVX-512 small-M GEMM tiles (AVX512F/BW/VL + AVX512-BF16): a block of up to 6 rows x 4 output
// features in 24 zmm accumulators (with the 4 weight vectors and an activation: 29 of the 32 registers).
//   bf16 x bf16 (bf16 weights, activations given as bf16): VDPBF16PS, 32 products per instruction,
//     fp32 accumulation; the products are exact, as on the other paths.
//   otherwise (fp32 activations): 16 fp32 lanes, weights widened as they are loaded (bf16 by a
//     shift, fp16 by VCVTPH2PS), FMA.
// Row tails are masked loads (zero-filled lanes add +0 to the sums).
#pragma once
#include <cstdint>

#include "gemm_types.h"
#include "isa_target.h"

#if SPECDEC_HAVE_X86_PATHS
#include <immintrin.h>

SPECDEC_BEGIN_TARGET_AVX512BF16
namespace specdec::cpu::avx512 {

static_assert(kTileN == 4, "the reductions below produce four outputs at a time");
// 6 rows, not 4: a verification pass of 5 or 9 rows was two or three blocks, the last of a single row
// (4 + 1, 4 + 4 + 1), which loads a weight vector per product; as one or two blocks (5, 5 + 4) the
// projections of the bundled target's pass ran 1.08x and 1.12x faster (12 interleaved pairs on a Zen 4,
// BENCHMARKS.md), one row and 4 and 8 rows unchanged.
constexpr int kTileM = 6;

// Fully unrolled loops over register arrays (here and in attention_avx512.h): an index left at run
// time keeps an array in memory, and the accumulators then go through the stack.
#define SPECDEC_UNROLL _Pragma("GCC unroll 16")

template <DType kW>
inline __m512 load16(const void* w, int64_t k, __mmask16 mask) {
  if constexpr (kW == DType::kF32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(w) + k);
  } else {
    // The zero-masking forms: GCC 12's unmasked ones warn about their own undefined pass-through
    // (-Wmaybe-uninitialized, GCC bug 105593); the instructions are the same.
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(w) + k);
    if constexpr (kW == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16));
    } else {
      return _mm512_maskz_cvtph_ps(0xffff, h);
    }
  }
}

// The sums of four accumulators' 16 lanes, each associated exactly as fold_sum<16> (lane l += lane
// l + 8, then + 4, + 2, + 1), four at a time: a tenth of the instructions of four scalar folds,
// which at K = 512 would cost as much as the dot products themselves. Written with
// __builtin_shufflevector: GCC 12's AVX-512 shuffle intrinsics warn about their own undefined
// pass-through operands (GCC bug 105593); the instructions are the same.
inline __m128 reduce16x4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 u01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512 u23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                     __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // 4-lane block j of x: accumulator j after the + 4 level
  const __m512 x = __builtin_shufflevector(u01, u23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                   __builtin_shufflevector(u01, u23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512 y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const __m512 z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return __builtin_shufflevector(z, z, 0, 4, 8, 12);
}

template <DType kW, int MB>
inline void tile_f32(const GemmActivations& a, int64_t m0, const GemmWeight& w, int64_t n0, int nt, float* out) {
  const void* rows[kTileN];
  for (int j = 0; j < kTileN; ++j) rows[j] = w.row(n0 + (j < nt ? j : nt - 1));  // spare lanes repeat a row
  const float* act[MB];
  for (int m = 0; m < MB; ++m) act[m] = a.f32 + (m0 + m) * a.ld_f32;
  __m512 acc[MB][kTileN];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < kTileN; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t K = w.cols;
  const int64_t element_bytes = kW == DType::kF32 ? 4 : 2;
  const int64_t ahead = prefetch_rows_ahead(w.ld, element_bytes) * w.ld * element_bytes;  // bytes
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xffff)
                                       : static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[kTileN];
    for (int j = 0; j < kTileN; ++j) wv[j] = load16<kW>(rows[j], k, mask);
    for (int j = 0; j < kTileN; ++j)
      prefetch_weights(static_cast<const char*>(rows[j]) + k * element_bytes + ahead);
    for (int m = 0; m < MB; ++m) {
      const __m512 av = _mm512_maskz_loadu_ps(mask, act[m] + k);
      for (int j = 0; j < kTileN; ++j) acc[m][j] = _mm512_fmadd_ps(av, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm_storeu_ps(out + m * kTileN, reduce16x4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

// bf16 x bf16 in a pass of one row, which gives the weight rows nothing to share: each weight row is
// streamed whole in turn, one sequential stream, which the L2 prefetcher follows, instead of
// tile_bf16's four interleaved 1-KB streams (read so to reuse each activation load for four rows).
// Only for a pass of one row: behind another row block, whose tile_bf16 just brought the tile into
// L1, its one dependency chain per row is slower than the interleaved loop. Each row's sum is the
// same instructions in the same order as in tile_bf16, so the result does not depend on the number
// of rows in the pass.
inline void tile_bf16_single_row(const uint16_t* act, const GemmWeight& w, int64_t n0, int nt, float* out) {
  __m512 acc[kTileN];
  const int64_t K = w.cols;
  const int64_t ahead = prefetch_rows_ahead(w.ld, 2) * w.ld;
  for (int j = 0; j < kTileN; ++j) {
    const uint16_t* row = static_cast<const uint16_t*>(w.row(n0 + (j < nt ? j : nt - 1)));
    acc[j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k);
      prefetch_weights(row + k + ahead);
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(act + k), wv);
    }
    if (k < K) {
      const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_maskz_loadu_epi16(mask, act + k),
                                (__m512bh)_mm512_maskz_loadu_epi16(mask, row + k));
    }
  }
  _mm_storeu_ps(out, reduce16x4(acc[0], acc[1], acc[2], acc[3]));
}

// bf16 x bf16, one row, kWideTiles tiles (16 features) at once, for weights that sit in cache (a draft
// model's): 16 independent accumulators and one activation load per 16 products, where a one-row tile
// has four dependency chains and tile_bf16_single_row one. Measured on a Zen 4 with the bundled draft's
// shapes (one thread, weights in L2/L3): its 8192 x 128 head 38 us against 55 us row by row, its
// 384 x 128 q/k/v 1.4 against 2.5 us. From memory it is the slowest (16 interleaved streams: 2.8 ms
// for the target's pass against 1.3 row by row), hence only for cached weights. Each output is the
// same instructions in the same order as in tile_bf16.
inline void tile_bf16_wide_row(const uint16_t* act, const GemmWeight& w, int64_t n0, float* out) {
  constexpr int kRows = kWideTiles * kTileN;
  __m512 acc[kRows];
  const uint16_t* rows[kRows];
  SPECDEC_UNROLL
  for (int j = 0; j < kRows; ++j) {
    rows[j] = static_cast<const uint16_t*>(w.row(n0 + j));
    acc[j] = _mm512_setzero_ps();
  }
  const int64_t K = w.cols;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh av = (__m512bh)_mm512_loadu_si512(act + k);
    SPECDEC_UNROLL
    for (int j = 0; j < kRows; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], av, (__m512bh)_mm512_loadu_si512(rows[j] + k));
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
    const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(mask, act + k);
    SPECDEC_UNROLL
    for (int j = 0; j < kRows; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], av, (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[j] + k));
  }
  SPECDEC_UNROLL
  for (int t = 0; t < kWideTiles; ++t)
    _mm_storeu_ps(out + kTileN * t, reduce16x4(acc[4 * t], acc[4 * t + 1], acc[4 * t + 2], acc[4 * t + 3]));
}

template <int MB>
inline void tile_bf16(const GemmActivations& a, int64_t m0, const GemmWeight& w, int64_t n0, int nt, float* out) {
  const uint16_t* rows[kTileN];
  for (int j = 0; j < kTileN; ++j)
    rows[j] = static_cast<const uint16_t*>(w.row(n0 + (j < nt ? j : nt - 1)));
  const uint16_t* act[MB];
  for (int m = 0; m < MB; ++m) act[m] = a.bf16 + (m0 + m) * a.ld_bf16;
  __m512 acc[MB][kTileN];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < kTileN; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t K = w.cols;
  int64_t k = 0;
  const int64_t ahead = prefetch_rows_ahead(w.ld, 2) * w.ld;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[kTileN];
    for (int j = 0; j < kTileN; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(rows[j] + k);
    for (int j = 0; j < kTileN; ++j) prefetch_weights(rows[j] + k + ahead);
    for (int m = 0; m < MB; ++m) {
      const __m512bh av = (__m512bh)_mm512_loadu_si512(act[m] + k);
      for (int j = 0; j < kTileN; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, wv[j]);
    }
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
    __m512bh wv[kTileN];
    for (int j = 0; j < kTileN; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[j] + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(mask, act[m] + k);
      for (int j = 0; j < kTileN; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], av, wv[j]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm_storeu_ps(out + m * kTileN, reduce16x4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

template <DType kW>
inline void tile_typed(const GemmActivations& a, int64_t m0, int mb, const GemmWeight& w, int64_t n0, int nt,
                       float* out) {
  const bool dot_bf16 = kW == DType::kBF16 && a.bf16 != nullptr;
  switch (mb) {
    case 6:
      return dot_bf16 ? tile_bf16<6>(a, m0, w, n0, nt, out) : tile_f32<kW, 6>(a, m0, w, n0, nt, out);
    case 5:
      return dot_bf16 ? tile_bf16<5>(a, m0, w, n0, nt, out) : tile_f32<kW, 5>(a, m0, w, n0, nt, out);
    case 4:
      return dot_bf16 ? tile_bf16<4>(a, m0, w, n0, nt, out) : tile_f32<kW, 4>(a, m0, w, n0, nt, out);
    case 3:
      return dot_bf16 ? tile_bf16<3>(a, m0, w, n0, nt, out) : tile_f32<kW, 3>(a, m0, w, n0, nt, out);
    case 2:
      return dot_bf16 ? tile_bf16<2>(a, m0, w, n0, nt, out) : tile_f32<kW, 2>(a, m0, w, n0, nt, out);
    default:
      return dot_bf16 ? tile_bf16<1>(a, m0, w, n0, nt, out) : tile_f32<kW, 1>(a, m0, w, n0, nt, out);
  }
}

// out[m * kTileN + j] = sum_k a[m0 + m, k] * w[n0 + j, k] for m < mb <= kTileM, j < nt <= kTileN.
inline void gemm_tile(const GemmActivations& a, int64_t m0, int mb, const GemmWeight& w, int64_t n0, int nt,
                      float* out) {
  with_dtype(w.type, [&](auto type) { tile_typed<decltype(type)::value>(a, m0, mb, w, n0, nt, out); });
}

// kWideTiles full tiles of one row (features n0 .. n0 + kWideTiles * kTileN - 1) into out, the same
// sums as gemm_tile.
inline void gemm_wide_row(const GemmActivations& a, int64_t m0, int mb, const GemmWeight& w, int64_t n0, int nt,
                          float* out) {
  if (w.type == DType::kBF16 && a.bf16 != nullptr) return tile_bf16_wide_row(a.bf16 + m0 * a.ld_bf16, w, n0, out);
  for (int t = 0; t < kWideTiles; ++t) gemm_tile(a, m0, mb, w, n0 + kTileN * t, kTileN, out + kTileN * t);
}

// gemm_tile for a pass of one row (mb == 1): the same sums, bf16 x bf16 read row by row.
inline void gemm_tile_single_row(const GemmActivations& a, int64_t m0, int mb, const GemmWeight& w, int64_t n0,
                                 int nt, float* out) {
  if (w.type == DType::kBF16 && a.bf16 != nullptr) return tile_bf16_single_row(a.bf16 + m0 * a.ld_bf16, w, n0, nt, out);
  gemm_tile(a, m0, mb, w, n0, nt, out);
}

}  // namespace specdec::cpu::avx512
SPECDEC_END_TARGET
#endif
