// The amxbf16 path's GEMM route: bf16 weights streamed from memory, multiplied on Intel AMX tiles
// (Sapphire Rapids and later), 16 output features x up to 16 activation rows x 32 of K per
// instruction. Everything else on that path is the avx512bf16 path's (simd/avx512.cpp).
//
// Why: on AVX-512 a verification pass of 9 rows costs about 2x a one-row pass and 16 rows 3x
// (VDPBF16PS multiplies each weight vector by one row at a time); an AMX tile multiplies each weight
// tile loaded by all the pass's rows at once, so a pass of up to 16 rows streams the weights at the
// memory's pace (benchmarks/bench_cpu_tiles.cpp; BENCHMARKS.md, "Intel AMX").
//
// The tiles: C = four 16-feature x M accumulators (tmm0-3, fp32), A = a weight tile, 16 features x 32
// bf16 of K (tmm4, tmm6 in turn) read from the weight's packed copy (pack_weight) where the caller
// gives one, else straight from the row-major weight, B = 16 pairs of K x M rows of activations in the
// VNNI layout (tmm5). A C element is the sum over K of its own products, in K
// order 32 at a time, whatever M, the other rows and the other features: the route is batch invariant
// (gemm_types.h), and its sums differ from avx512bf16's (which folds 16 lanes) only in rounding.
//
// Which outputs take the route (small_gemm.h's gemm_tiles): those of the full 16-feature groups of a
// bf16 weight with K a multiple of 32, bf16 activations, read from memory (not weights_cached: a small
// draft model's cached passes keep avx512bf16's wide tiles, faster there); the rest of a weight's
// features take the avx512bf16 tiles. The choice depends on the weight and the model, never on M.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernel_common.h"

// (the layouts, plain C++ on every platform; the tile code is x86 only)
namespace specdec::cpu::amx {

constexpr int kGroup = 16;        // output features per A tile (its rows) and per C tile (its rows)
constexpr int kTileK = 32;        // bf16 of K per A tile row: 64 bytes
constexpr int kPairRows = 16;     // pairs of K per B tile (its rows): kTileK / 2
constexpr int kMaxRows = 16;      // activation rows per B tile (its columns): 16 pairs = 64 bytes
constexpr int kAccumulators = 4;  // C tiles per sweep over K
constexpr int kPrefetchSteps = 4;  // packed tiles: one line each this many steps of K ahead (measured: 1-16
                                   // ahead, into L1 or L2, every line or one, all within noise)

// Whether weight w's full groups take the route with these activations (see the top of this file).
inline bool takes_route(const GemmActivations& a, const GemmWeight& w) {
  return a.vnni != nullptr && w.type == DType::kBF16 && w.cols % kTileK == 0;
}

inline int64_t full_groups(const GemmWeight& w) { return w.rows / kGroup; }

// Shape: packed [N / 16][K / 32][16][32] bf16 elements: the full groups' A tiles, each 1 KB in one piece.
inline int64_t packed_elements(const GemmWeight& w) { return full_groups(w) * kGroup * w.cols; }

// Shape: w [N, K] bf16 (row stride w.ld) -> packed [N / 16][K / 32][16][32]. The same bits as the weight
// in the order the route reads them: one sequential stream per group instead of 16 strided rows (a pass
// of one row from memory, 1.2-1.4x faster so, BENCHMARKS.md). The sums do not change.
inline void pack_weight(const GemmWeight& w, uint16_t* packed) {
  const int64_t steps = w.cols / kTileK;
  for (int64_t g = 0; g < full_groups(w); ++g)
    for (int64_t k = 0; k < steps; ++k)
      for (int f = 0; f < kGroup; ++f)
        std::memcpy(packed + ((g * steps + k) * kGroup + f) * kTileK,
                    static_cast<const uint16_t*>(w.row(g * kGroup + f)) + k * kTileK, kTileK * sizeof(uint16_t));
}

// Shape: vnni [ceil(M / 16)][K / 2][r][2] bf16 elements, r = the block's rows (16, or what the last has):
// block b at b * K * 16.
inline int64_t vnni_elements(int64_t M, int64_t K) { return (M + kMaxRows - 1) / kMaxRows * K * kMaxRows; }

// Shape: x [M, K] bf16 bits, row stride ld -> vnni as above: each block's pairs of K side by side, as a
// B tile of the block's rows reads them (one row: the row itself).
inline void pack_vnni(const uint16_t* x, int64_t ld, int64_t M, int64_t K, uint16_t* vnni) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
    const int64_t rows = M - m0 < kMaxRows ? M - m0 : kMaxRows;
    uint16_t* block = vnni + (m0 / kMaxRows) * K * kMaxRows;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) block[(k / 2) * rows * 2 + r * 2 + (k & 1)] = x[(m0 + r) * ld + k];
  }
}

}  // namespace specdec::cpu::amx

#if SPECDEC_HAVE_X86_PATHS
#include <immintrin.h>

SPECDEC_BEGIN_TARGET_AMX
namespace specdec::cpu::amx {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

// The tiles for B tiles of `rows` activation rows (C tiles of as many columns). Tile state is per
// thread, and other code on the thread (oneDNN's AMX kernels inside torch) configures its own, so
// every route call configures on entry and releases on exit.
inline void configure(int rows) {
  TileConfig config;
  std::memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < kAccumulators; ++t) config.rows[t] = kGroup, config.bytes_per_row[t] = rows * 4;
  config.rows[4] = config.rows[6] = kGroup, config.bytes_per_row[4] = config.bytes_per_row[6] = kTileK * 2;
  config.rows[5] = kPairRows, config.bytes_per_row[5] = rows * 4;
  // (not _tile_loadconfig: GCC 12 drops the stores into a local config before its builtin, whose read
  // of the whole struct it does not see; the asm's memory operand is the struct itself)
  __asm__ volatile("ldtilecfg %0" : : "m"(config));
}

inline void release() { _tile_release(); }

// C tile c = sum over K of A tiles a[c] (16 features, row stride a_stride[c] bytes, the next 32 of K
// a_step elements on) times the B tiles of b (Shape: [K / 2][rows][2]).
// Shape: c [kC][16 features][rows] fp32 (each tile at c + t * kGroup * kMaxRows)
// Packed tiles (kPacked) are prefetched kPrefetchSteps steps of K ahead, one line per tile and step.
template <int kC, bool kPacked>
inline void sweep(const uint16_t* const* a, int64_t a_step, const int64_t* a_stride, const uint16_t* b, int64_t k_steps,
                  int rows, float* c) {
  static_assert(kC >= 1 && kC <= kAccumulators);
  _tile_zero(0);  // (the _tile_ intrinsics are statements: asm macros with constant tile numbers)
  if constexpr (kC > 1) _tile_zero(1);
  if constexpr (kC > 2) _tile_zero(2);
  if constexpr (kC > 3) _tile_zero(3);
  for (int64_t k = 0; k < k_steps; ++k) {
    if constexpr (kPacked)
      for (int t = 0; t < kC; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(a[t] + (k + kPrefetchSteps) * a_step), _MM_HINT_T0);
    _tile_loadd(5, b + k * kPairRows * rows * 2, rows * 4);
    _tile_loadd(4, a[0] + k * a_step, a_stride[0]);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (kC > 1) {
      _tile_loadd(6, a[1] + k * a_step, a_stride[1]);
      _tile_dpbf16ps(1, 6, 5);
    }
    if constexpr (kC > 2) {
      _tile_loadd(4, a[2] + k * a_step, a_stride[2]);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (kC > 3) {
      _tile_loadd(6, a[3] + k * a_step, a_stride[3]);
      _tile_dpbf16ps(3, 6, 5);
    }
  }
  constexpr int64_t kTile = kGroup * kMaxRows;
  _tile_stored(0, c, rows * 4);
  if constexpr (kC > 1) _tile_stored(1, c + kTile, rows * 4);
  if constexpr (kC > 2) _tile_stored(2, c + 2 * kTile, rows * 4);
  if constexpr (kC > 3) _tile_stored(3, c + 3 * kTile, rows * 4);
}

// Groups g0 .. g0 + groups - 1 of the `count` weights (which share their shape) for activation block
// `block` (its rows: `rows`), the tiles configured for `rows`: C tile gi * count + i holds weight i's
// group g0 + gi. Shape: c [groups * count][16 features][rows] fp32, tiles kGroup * kMaxRows apart.
inline void multiply_groups(const GemmActivations& a, int64_t block, int rows, const GemmWeight* weights, int count,
                            int64_t g0, int groups, float* c) {
  const int64_t K = weights[0].cols;
  const uint16_t* tiles[kAccumulators];
  int64_t stride[kAccumulators];
  const int64_t steps = K / kTileK;
  const bool packed = weights[0].amx_packed != nullptr && (count == 1 || weights[1].amx_packed != nullptr);
  for (int gi = 0; gi < groups; ++gi)
    for (int i = 0; i < count; ++i) {
      const GemmWeight& w = weights[i];
      tiles[gi * count + i] = packed ? w.amx_packed + (g0 + gi) * steps * kGroup * kTileK
                                     : static_cast<const uint16_t*>(w.row((g0 + gi) * kGroup));
      stride[gi * count + i] = packed ? kTileK * 2 : w.ld * 2;
    }
  const uint16_t* b = a.vnni + block * K * kMaxRows;
  const int64_t step = packed ? kGroup * kTileK : kTileK;
  auto run = [&](auto packed_tiles) {
    constexpr bool kPacked = decltype(packed_tiles)::value;
    switch (groups * count) {
      case 1:
        return sweep<1, kPacked>(tiles, step, stride, b, steps, rows, c);
      case 2:
        return sweep<2, kPacked>(tiles, step, stride, b, steps, rows, c);
      case 3:
        return sweep<3, kPacked>(tiles, step, stride, b, steps, rows, c);
      default:
        return sweep<4, kPacked>(tiles, step, stride, b, steps, rows, c);
    }
  };
  if (packed) return run(std::true_type{});
  run(std::false_type{});
}

}  // namespace specdec::cpu::amx
SPECDEC_END_TARGET
#endif
