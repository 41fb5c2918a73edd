// What the small-M GEMM kernels (gemm_portable.h, gemm_avx2.h, gemm_avx512.h) read and write.
//
// out[m, n] = sum_k a[m, k] * w[n, k] for a tile of up to kTileM rows and kTileN output features,
// with w in its natural [N, K] row-major layout (the HF weight itself: no repacking, no copy). Every
// weight row of a tile is streamed once while all the tile's activation rows, which sit in L1, are
// multiplied with it; looping over row blocks inside an output tile keeps the weights read from
// memory once per pass whatever the number of rows.
//
// Batch invariance: out[m, n] is computed by the same instructions in the same order whatever M, the
// row block m falls in and the thread that runs it (accumulation over k in fixed steps, then a fixed
// reduction tree per accumulator), so a row's result does not depend on what else is in the pass. A
// verification pass therefore gives bit for bit the logits a one-token pass would: speculative greedy
// decoding reproduces plain greedy decoding exactly on every path (each path on its own; the paths
// differ from one another in rounding).
#pragma once
#include <cstdint>

#include "isa_target.h"
#include "numeric.h"

#if SPECDEC_HAVE_X86_PATHS
#include <xmmintrin.h>
#endif

namespace specdec::cpu {

constexpr int kTileN = 4;  // output features per tile, on every path (the threads split tiles)

// The SIMD tiles prefetch the weight rows this many tiles ahead: the hardware prefetchers alone left
// a one-row pass at 27 GB/s where this reaches 35-38 (this VM's copy bandwidth), and at 4-9 rows the
// stalls on the first row block had cost 1.7-2x.
constexpr int kPrefetchTiles = 2;
// ... and at least this many bytes ahead: two tiles of a draft model's 128-wide rows are 2 KB, less
// than a memory latency's worth of its work once a verification pass has pushed it out of cache. On the
// bundled draft (Zen 4, one thread) its first two-token pass after a 64-MB sweep went from 0.70-0.83 to
// 0.47-0.53 ms and a draft step inside decoding from 1.26-1.85 to 1.16-1.48 ms (three interleaved
// pairs); the target's rows (1 KB and more) are prefetched two tiles ahead as before.
constexpr int64_t kPrefetchMinBytes = 8 << 10;

// The weight lines are prefetched into L2 (PREFETCHT2), not into L1: a prefetch into L1 (T0, or NTA,
// which on AMD cores also fills L1) holds one of L1's few miss buffers until its line arrives, which
// at a VM's memory latency capped a core at 10-13 GB/s on a Zen 4, while the L2 has many more. There
// the one-token forward of the bundled target went from 3.0-3.9 to 2.0 ms at one thread (NTA
// against T2, BENCHMARKS.md), plain decoding 1.6x, speculative 1.3x. A tile's rows are four
// interleaved 1-KB streams, too short for the hardware prefetchers to follow, so without a software
// prefetch the same pass ran at about half the bandwidth. (On a Zen 5 NTA had been 1.1-1.2x faster
// than T0, by keeping the 45 MB of weights from pushing the KV cache and the host code out of L2 and
// L3; T2 was not measured there.)
template <bool kIntoL1>
inline void prefetch_line(const void* line) {
#if SPECDEC_HAVE_X86_PATHS
  _mm_prefetch(static_cast<const char*>(line), kIntoL1 ? _MM_HINT_T0 : _MM_HINT_T2);
#else
  __builtin_prefetch(line, 0, kIntoL1 ? 3 : 1);
#endif
}
inline void prefetch_weights(const void* line) { prefetch_line<false>(line); }

// A cache line wanted soon, into L1 (the attention's keys and values, a few rows ahead).
inline void prefetch_near(const void* line) { prefetch_line<true>(line); }

// How far ahead (in rows of w) the SIMD tiles prefetch: kPrefetchTiles tiles, or kPrefetchMinBytes.
inline int64_t prefetch_rows_ahead(int64_t ld, int64_t element_bytes) {
  const int64_t rows = (kPrefetchMinBytes + ld * element_bytes - 1) / (ld * element_bytes);
  return rows > kPrefetchTiles * kTileN ? rows : kPrefetchTiles * kTileN;
}

// The activations A [M, K] as the kernels read them. f32 holds the values every path multiplies
// (already rounded to bf16 when the products are bf16 x bf16); bf16 holds the same values as bf16
// bits for the AVX512-BF16 dot product, or is null when the products are fp32; vnni, on the amxbf16
// path only, the same bits as AMX B tiles read them (simd/amx.h: pack_vnni), or null.
struct GemmActivations {
  const float* f32;
  int64_t ld_f32;
  const uint16_t* bf16;
  int64_t ld_bf16;
  const uint16_t* vnni = nullptr;  // Shape: [ceil(M / 16)][K / 2][rows of the block][2]
};

// A weight W [rows, cols] row-major with row stride ld, of dtype type (fp32, bf16 or fp16).
struct GemmWeight {
  const void* data;
  DType type;
  int64_t rows, cols, ld;
  // On the amxbf16 path, where given: the same weight's full 16-row groups as AMX tiles
  // (simd/amx.h: pack_weight), which the route reads instead of data. The sums do not change.
  const uint16_t* amx_packed = nullptr;

  const void* row(int64_t n) const {
    const int64_t bytes = type == DType::kF32 ? 4 : 2;
    return static_cast<const char*>(data) + n * ld * bytes;
  }
};

// How a path's kernels are shaped (each path's Vec::kTuning, measured on it: simd/<path>.h).
struct PathTuning {
  int tile_m;              // the GEMM's row block: tile_m x kTileN accumulator vectors
  bool feature_outer;      // a block's k step runs feature by feature (one weight vector live), else all
                           // kTileN weight vectors first and each activation loaded once
  int wide_tiles;          // tiles of one row from cached weights at once (0: none)
  int rows_by_row;         // a pass of bf16 pairs of at most this many rows reads each tile's weight rows one
                           // after the other (0: none)
  int value_chunks;        // attention: value vectors per query held in registers
};

constexpr int kMaxTileM = 6;      // the largest row block of the paths (Vec::kTuning.tile_m)
constexpr int kMaxWideTiles = 4;  // the largest Vec::kTuning.wide_tiles

using TileFn = void (*)(const GemmActivations&, int64_t, int, const GemmWeight&, int64_t, int, float*);

// One instruction-set path's tiles (simd/gemm_impl.inc), for small_gemm.h's driver.
struct TilePath {
  TileFn tile;        // out[m * kTileN + j] for m < mb <= tile_m, j < nt <= kTileN
  int tile_m;         // the largest row block
  TileFn few_rows;    // the tile of a pass of at most few_rows_m rows: the same sums, possibly read in
  int few_rows_m;     // another order (rows_by_row, or 1)
  TileFn wide_row;    // wide_tiles full tiles of one row at once from cached weights (the same sums), or null
  int wide_tiles;
  bool bf16_dot;      // bf16 x bf16 products from bf16 activations (GemmActivations::bf16) where they are given
};

// Sum of 2^p lanes by folding halves (lane l += lane l + w for w = n/2, n/4, ..., 1): the tree the
// SIMD reductions use, so that a value does not depend on how its lanes were produced.
template <int kLanesP2>
inline float fold_sum(float* lanes) {
  for (int width = kLanesP2 / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

}  // namespace specdec::cpu
