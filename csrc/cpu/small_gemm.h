// The GEMM driver: prepares the activations once per call (optional RMSNorm, optional rounding to bf16)
// and runs one instruction-set path's kernel over a range of output tiles, handing each finished block
// to an epilogue. No torch: threads and tensors are the caller's (lean_forward.cpp).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gemm_types.h"
#include "isa.h"
#include "simd/amx.h"
#include "simd/paths.h"

namespace specdec::cpu {

// A[m, :] = x[m, :] (fp32), optionally RMS-normalised and scaled, a = x * rsqrt(mean(x^2) + eps) * g
// (g fp32), optionally rounded to bf16 (a32 then holds the rounded values; a16, when given, the same
// as bf16 bits). Rows are independent of each other (batch invariance). Branch-free loops: they
// vectorise, which matters when a call's rows outnumber its weight rows' work (the pass's head).
inline void prepare_activations(const float* x, int64_t ldx, int64_t M, int64_t K, const float* norm_weight,
                                float eps, bool round_bf16, float* a32, int64_t lda32, uint16_t* a16,
                                int64_t lda16) {
  constexpr int kLanes = 16;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    float* out = a32 + m * lda32;
    if (norm_weight != nullptr) {
      float lanes[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += row[k + l] * row[k + l];
      for (int l = 0; k + l < K; ++l) lanes[l] += row[k + l] * row[k + l];
      const float mean = fold_sum<kLanes>(lanes) / static_cast<float>(K);
      const float scale = 1.0f / std::sqrt(mean + eps);
      for (k = 0; k < K; ++k) out[k] = row[k] * scale * norm_weight[k];
    } else {
      for (int64_t k = 0; k < K; ++k) out[k] = row[k];
    }
    if (!round_bf16) continue;
    uint16_t* bits = a16 != nullptr ? a16 + m * lda16 : nullptr;
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t u = float_to_bits(out[k]);
      const uint32_t nearest = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
      const uint32_t h = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : nearest;  // NaN stays NaN
      out[k] = bits_to_float(h << 16);
      if (bits != nullptr) bits[k] = static_cast<uint16_t>(h);
    }
  }
}

inline TilePath tile_path(Isa isa) {
  switch (isa) {
#if SPECDEC_HAVE_X86_PATHS
    case Isa::kAmxBf16:  // (its AMX route: gemm_tiles)
    case Isa::kAvx512Bf16:
      return avx512::tile_path();
    case Isa::kAvx2:
      return avx2::tile_path();
#endif
#if SPECDEC_HAVE_NEON_PATH
    case Isa::kNeon:
      return neon::tile_path();
#endif
    default:
      return portable::tile_path();
  }
}

// The activations of one call as path `isa`'s kernels read them (GemmActivations): prepare_activations'
// a32, its bf16 bits where the path multiplies bf16 pairs, and on amxbf16 the same bits as AMX B tiles
// where the weights stream from memory (weights_cached false) and K is a multiple of 32. Rows: K apart.
struct ActivationBuffers {
  std::vector<float> a32;
  std::vector<uint16_t> a16, vnni;
};

inline GemmActivations prepare_gemm_activations(Isa isa, const float* x, int64_t M, int64_t K, const float* norm_weight,
                                                float eps, bool round_bf16, bool weights_cached, ActivationBuffers& b) {
  const bool pairs = round_bf16 && tile_path(isa).bf16_dot;
  const bool amx = pairs && isa == Isa::kAmxBf16 && !weights_cached && K % amx::kTileK == 0;
  b.a32.resize(M * K);
  if (pairs) b.a16.resize(M * K);
  prepare_activations(x, K, M, K, norm_weight, eps, round_bf16, b.a32.data(), K, pairs ? b.a16.data() : nullptr, K);
  if (amx) {
    b.vnni.resize(amx::vnni_elements(M, K));
    amx::pack_vnni(b.a16.data(), K, M, K, b.vnni.data());
  }
  return {b.a32.data(), K, pairs ? b.a16.data() : nullptr, K, amx ? b.vnni.data() : nullptr};
}

// w with its panels for path `isa` and these activations, packed into `storage`: for the callers that
// hold no packed copies of their own (packed_weights.h), the kernel tests and benchmarks.
inline GemmWeight with_panels(Isa isa, const GemmActivations& a, GemmWeight w, std::vector<unsigned char>& storage) {
  const PanelLayout layout = tile_path(isa).layout(w.type, a.bf16 != nullptr);
  storage.resize(packed_panel_bytes(w, layout));
  pack_panels(w, layout, storage.data());
  w.panels = storage.data();
  return w;
}

constexpr int kMaxGemmWeights = 2;

inline int64_t num_tiles(int64_t rows) { return (rows + kTileN - 1) / kTileN; }

#if SPECDEC_HAVE_X86_PATHS
// The amxbf16 route (simd/amx.h) over the output tiles [tile_begin, tile_end) that fall in full 16-feature
// groups: every row block of up to 16 rows per group, then epilogue per tile as gemm_tiles. A group
// that the range cuts is computed whole and only the range's tiles are handed on. Returns the first
// tile after the range's full groups (the rest take the avx512bf16 tiles).
template <typename Epilogue>
inline int64_t amx_gemm_tiles(const GemmActivations& a, int64_t M, const GemmWeight* weights, int count,
                              int64_t tile_begin, int64_t tile_end, Epilogue&& epilogue) {
  constexpr int kTilesPerGroup = amx::kGroup / kTileN;
  const int64_t last_group = std::min(amx::full_groups(weights[0]), (tile_end + kTilesPerGroup - 1) / kTilesPerGroup);
  const int per_sweep = amx::kAccumulators / count;
  alignas(64) float c[amx::kAccumulators][amx::kGroup * amx::kMaxRows];
  float parts[kMaxGemmWeights][amx::kMaxRows * kTileN];
  const float* tiles[kMaxGemmWeights] = {parts[0], parts[1]};
  int configured = 0;  // the B tiles' rows the tiles are configured for
  for (int64_t g = tile_begin / kTilesPerGroup; g < last_group; g += per_sweep) {
    const int groups = static_cast<int>(std::min<int64_t>(per_sweep, last_group - g));
    for (int64_t m0 = 0; m0 < M; m0 += amx::kMaxRows) {
      const int mb = static_cast<int>(std::min<int64_t>(amx::kMaxRows, M - m0));
      if (mb != configured) amx::configure(configured = mb);
      amx::multiply_groups(a, m0 / amx::kMaxRows, mb, weights, count, g, groups, c[0]);
      for (int gi = 0; gi < groups; ++gi)
        for (int q = 0; q < kTilesPerGroup; ++q) {
          const int64_t t = (g + gi) * kTilesPerGroup + q;
          if (t < tile_begin || t >= tile_end) continue;
          for (int i = 0; i < count; ++i) {
            const float* group = c[gi * count + i] + q * kTileN * mb;  // [16 features][mb rows]
            for (int m = 0; m < mb; ++m)
              for (int j = 0; j < kTileN; ++j) parts[i][m * kTileN + j] = group[j * mb + m];
          }
          epilogue(m0, mb, t * kTileN, kTileN, tiles, kTileN);
        }
    }
  }
  if (configured != 0) amx::release();
  return std::max(tile_begin, last_group * kTilesPerGroup);
}
#endif

// For the output tiles [tile_begin, tile_end) (features t*kTileN ..) and every row block:
// parts[i][m * ld + j] = sum_k A[m0 + m, k] * weights[i][n0 + j, k] for the `count` weights (which share
// their shapes, e.g. the gate and up projections), then epilogue(m0, mb, n0, nt, parts, ld), for the range's
// features of one block of panels at a time (a block the range cuts is computed whole; the threads split
// at whole blocks). weights_cached: the weights sit in cache (a small draft model's, read pass after pass):
// on amxbf16 a streamed bf16 weight's full 16-feature groups take amx_gemm_tiles, whatever M; the rest
// read the weights' panels (GemmWeight::panels, in path.layout).
template <typename Epilogue>
inline void gemm_tiles(Isa isa, const GemmActivations& a, int64_t M, const GemmWeight* weights, int count,
                       int64_t tile_begin, int64_t tile_end, [[maybe_unused]] bool weights_cached,
                       Epilogue&& epilogue) {
#if SPECDEC_HAVE_X86_PATHS
  if (isa == Isa::kAmxBf16 && !weights_cached && amx::takes_route(a, weights[0])) {
    tile_begin = amx_gemm_tiles(a, M, weights, count, tile_begin, tile_end, epilogue);
    if (tile_begin >= tile_end) return;
  }
#endif
  const TilePath path = tile_path(isa);
  const int64_t group = int64_t{path.group} * path.lanes;  // features per block
  float buffers[kMaxGemmWeights][kMaxPanelRows * kMaxGroupFeatures];
  const int64_t N = weights[0].rows;
  const int64_t begin = tile_begin * kTileN, end = std::min(tile_end * kTileN, N);
  // The fewest row blocks, as even as can be (9 rows: 5 + 4, not 6 + 3): a block of few rows reloads the
  // panels for few products. Which block a row falls in does not change its sum (batch invariance).
  const int64_t blocks = (M + path.panel_rows - 1) / path.panel_rows;
  const int64_t block = (M + blocks - 1) / blocks;
  for (int64_t g = begin / group; g * group < end; ++g) {
    const int64_t n0 = std::max(begin, g * group), n1 = std::min(end, (g + 1) * group);
    const float* parts[kMaxGemmWeights] = {buffers[0] + (n0 - g * group), buffers[1] + (n0 - g * group)};
    for (int64_t m0 = 0; m0 < M; m0 += block) {
      const int mb = static_cast<int>(M - m0 < block ? M - m0 : block);
      for (int i = 0; i < count; ++i) path.panels(a, m0, mb, weights[i], g * path.group, buffers[i], group);
      epilogue(m0, mb, n0, static_cast<int>(n1 - n0), parts, group);
    }
  }
}

}  // namespace specdec::cpu
