// The portable small-M GEMM tile (any CPU; plain C++ that the compiler vectorises for the baseline
// instruction set): 16 independent fp32 accumulators per output, folded by gemm_types.h's tree.
// Also the reference path the SIMD tiles are compared with in cpp_tests.
#pragma once
#include <cstdint>

#include "gemm_types.h"

namespace specdec::cpu::portable {

constexpr int kTileM = 4;
constexpr int kLanes = 16;

template <DType kW>
inline float dot(const float* a, const void* w, int64_t K) {
  float lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[k + l] * load_as_float<kW>(w, k + l);
  for (int l = 0; k + l < K; ++l) lanes[l] += a[k + l] * load_as_float<kW>(w, k + l);
  return fold_sum<kLanes>(lanes);
}

template <DType kW>
inline void tile_typed(const GemmActivations& a, int64_t m0, int mb, const GemmWeight& w, int64_t n0, int nt,
                       float* out) {
  for (int j = 0; j < nt; ++j) {
    const void* row = w.row(n0 + j);
    for (int m = 0; m < mb; ++m) out[m * kTileN + j] = dot<kW>(a.f32 + (m0 + m) * a.ld_f32, row, w.cols);
  }
}

// out[m * kTileN + j] = sum_k a.f32[m0 + m, k] * w[n0 + j, k] for m < mb <= kTileM, j < nt <= kTileN.
inline void gemm_tile(const GemmActivations& a, int64_t m0, int mb, const GemmWeight& w, int64_t n0, int nt,
                      float* out) {
  with_dtype(w.type, [&](auto type) { tile_typed<decltype(type)::value>(a, m0, mb, w, n0, nt, out); });
}

}  // namespace specdec::cpu::portable
