// What the GEMM kernels (simd/gemm_impl.inc, compiled per path; simd/amx.h) read and write.
//
// out[m, n] = sum_k a[m, k] * w[n, k]. The weight is read from a packed copy in panels: a panel is
// `lanes` output features (a path's vector width) side by side for every k, so a k step multiplies one
// weight vector by one activation broadcast into every lane, and each lane accumulates one output over
// k on its own: no horizontal reduction, and each panel is one sequential stream. Packed once per
// weight (packed_weights.h), the copy costs a second copy of the weights. The natural [N, K] layout
// (the HF weight itself) is what the copy is made from, and what amx.h's route reads where no AMX copy
// is given.
//
// Batch invariance: out[m, n] is computed by the same instructions in the same order whatever M, the
// row block m falls in, the panels computed beside it and the thread that runs it (one accumulator
// lane over k in fixed steps from zero), so a row's result does not depend on what else is in the
// pass. A verification pass therefore gives bit for bit the logits a one-token pass would: speculative
// greedy decoding reproduces plain greedy decoding exactly on every path (each path on its own; the
// paths differ from one another in rounding).
#pragma once
#include <cstdint>
#include <cstring>

#include "isa_target.h"
#include "numeric.h"

#if SPECDEC_HAVE_X86_PATHS
#include <xmmintrin.h>
#endif

namespace specdec::cpu {

constexpr int kTileN = 4;  // output features per tile: the unit of the ops' index space (the kernels compute groups)

// The panels are prefetched this many bytes ahead of the step that reads them, one line per panel and
// 64 bytes of it (measured on a Zen 4: 1 and 2 KB within noise; without it a pass from memory waits
// on every panel's first lines).
constexpr int64_t kPanelPrefetchBytes = 1024;

// The weight lines are prefetched into L2 (PREFETCHT2), not into L1: a prefetch into L1 (T0, or NTA,
// which on AMD cores also fills L1) holds one of L1's few miss buffers until its line arrives, which
// at a VM's memory latency capped a core at 10-13 GB/s on a Zen 4, while the L2 has many more. There
// the one-token forward of the bundled target went from 3.0-3.9 to 2.0 ms at one thread (NTA
// against T2, BENCHMARKS.md), plain decoding 1.6x, speculative 1.3x (with the former row-major tiles,
// whose rows were interleaved 1-KB streams, too short for the hardware prefetchers to follow: without a
// software prefetch the same pass ran at about half the bandwidth). (On a Zen 5 NTA had been 1.1-1.2x faster
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

// How a path packs a weight into panels: `lanes` output features per panel, `pair` consecutive k per
// step (2 for bf16 pair products, else 1), elements of `bytes` (the weight's own dtype: 4 or 2).
// Shape: [panel_count][ceil(K / pair)][lanes][pair] elements, zero where n >= N or k >= K.
// The panels come in whole groups of `group` (kMaxGroupFeatures / lanes: what a block computes), the last
// group's spare panels zero, so that every block reads whole groups.
struct PanelLayout {
  int lanes, pair, bytes, group;
};

// A weight W [rows, cols] row-major with row stride ld, of dtype type (fp32, bf16 or fp16).
struct GemmWeight {
  const void* data;
  DType type;
  int64_t rows, cols, ld;
  // The same weight packed in the path's PanelLayout (pack_panels), which every kernel but the AMX
  // route reads: the caller packs (packed_weights.h; the kernel tests and benchmarks pack their own).
  const void* panels = nullptr;
  // On the amxbf16 path, where given: the same weight's full 16-row groups as AMX tiles
  // (simd/amx.h: pack_weight), which the route reads instead of data. The sums do not change.
  const uint16_t* amx_packed = nullptr;

  const void* row(int64_t n) const {
    const int64_t bytes = type == DType::kF32 ? 4 : 2;
    return static_cast<const char*>(data) + n * ld * bytes;
  }
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int64_t panel_count(const GemmWeight& w, const PanelLayout& l) {
  return ceil_div(ceil_div(w.rows, l.lanes), l.group) * l.group;
}

// Bytes of one panel: every k step of `lanes` x `pair` elements.
inline int64_t panel_bytes(const GemmWeight& w, const PanelLayout& l) {
  return ceil_div(w.cols, l.pair) * l.lanes * l.pair * l.bytes;
}

inline int64_t packed_panel_bytes(const GemmWeight& w, const PanelLayout& l) {
  return panel_count(w, l) * panel_bytes(w, l);
}

// Shape: w [N, K] (row stride w.ld) -> out [panel_count][ceil(K / pair)][lanes][pair], zero padded:
// the same bits in the order the kernels read them. (Row by row: each weight row read once, in order.)
template <typename T, int kPair>
inline void pack_panels_as(const GemmWeight& w, const PanelLayout& l, T* out) {
  const int64_t step = int64_t{l.lanes} * kPair, panel = ceil_div(w.cols, kPair) * step;
  std::memset(out, 0, panel_count(w, l) * panel * sizeof(T));
  for (int64_t n = 0; n < w.rows; ++n) {
    const T* src = static_cast<const T*>(w.row(n));
    T* dst = out + (n / l.lanes) * panel + (n % l.lanes) * kPair;
    for (int64_t k = 0; k < w.cols; ++k) dst[(k / kPair) * step + k % kPair] = src[k];
  }
}

inline void pack_panels(const GemmWeight& w, const PanelLayout& l, void* out) {
  if (l.bytes == 4) return pack_panels_as<uint32_t, 1>(w, l, static_cast<uint32_t*>(out));
  if (l.pair == 2) return pack_panels_as<uint16_t, 2>(w, l, static_cast<uint16_t*>(out));
  pack_panels_as<uint16_t, 1>(w, l, static_cast<uint16_t*>(out));
}

constexpr int kMaxPanelRows = 6;       // the largest row block of the paths (Vec::kTuning.panel_rows)
constexpr int kMaxGroupFeatures = 64;  // the features of a group of panels (kMaxGroupFeatures / lanes panels)

// How a path's kernels are shaped (each path's Vec::kTuning, measured on it: simd/<path>.h).
struct PathTuning {
  int panel_rows;                      // the GEMM's row block
  int block_panels[kMaxPanelRows];     // a block of r rows computes block_panels[r - 1] panels of the group at a
                                       // time (r x that many accumulator vectors): as many as keep the
                                       // multiply-adds' latency hidden in the registers the path has
  int value_chunks;                    // attention: value vectors per query held in registers
};

// out[m * ld + f] = sum_k A[m0 + m, k] * w[p0 * lanes + f, k] for m < mb <= panel_rows and the features of
// the group of panels from p0 (a multiple of the group; features past N read zero weights).
using PanelFn = void (*)(const GemmActivations&, int64_t m0, int mb, const GemmWeight&, int64_t p0, float* out,
                         int64_t ld);

// One instruction-set path's GEMM (simd/gemm_impl.inc), for small_gemm.h's driver.
struct TilePath {
  PanelFn panels;
  PanelLayout (*layout)(DType weight, bool bf16_activations);  // what `panels` reads weights of that dtype in
  int panel_rows;    // the largest row block
  int group;         // panels per block
  int lanes;         // features per panel
  bool bf16_dot;     // bf16 x bf16 products from bf16 activations (GemmActivations::bf16) where they are given
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
