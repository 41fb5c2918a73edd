// Cache attention on the AVX-512 path (see attention.h for the contract and the key order). The
// generic loops of attention_impl.inc spend most of their time folding each key's 16 partial sums
// one scalar at a time; here four keys' sums are folded together by gemm_avx512.h's reduce16x4 (the
// same tree per key, so grouping keys does not change a score), and the cache rows are widened from
// bf16/fp16 with the GEMM's loads.
#pragma once
#include <cstdint>

#include "attention_types.h"
#include "gemm_avx512.h"
#include "isa_target.h"
#include "vector_math.h"

#if SPECDEC_HAVE_X86_PATHS
#include <immintrin.h>

SPECDEC_BEGIN_TARGET_AVX512BF16
namespace specdec::cpu::avx512 {

constexpr int kMaxChunks = 32;  // 16-float chunks of a head (head_dim <= 512)

inline __mmask16 lanes_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << remaining) - 1u);
}

// Cache rows fetched ahead, every 64-byte line of them: a pass's weights evict the cache from L3, so
// the keys and values stream from memory. Measured on the bundled target's shape (6 layers x 8 heads x
// 251 keys, bf16): 0.09 ms from cache, 0.21 ms evicted (3 MB at about 25 GB/s), 0.22-0.26 ms with 8
// rows of one line ahead.
constexpr int kPrefetchKeys = 32;

// scores[i] = (q . K[slot(i)]) * scale for i < n, four keys at a time (spare lanes repeat a key).
// kChunks: the head's 16-float chunks when there are at most 8 of them (q then sits in registers),
// 0 for a longer head (chunks counted at run time).
template <DType kCache, int kChunks, typename Slot>
inline void key_scores(const AttentionProblem& p, const float* q, int64_t base, int64_t n, const Slot& slot,
                       float* scores) {
  const int64_t D = p.head_dim;
  const int chunks = kChunks > 0 ? kChunks : static_cast<int>((D + 15) / 16);
  constexpr int kHeld = kChunks > 0 ? kChunks : 1;
  __m512 qv[kHeld];
  __mmask16 masks[kMaxChunks];
  for (int c = 0; c < chunks; ++c) masks[c] = lanes_mask(D - 16 * c);
  if constexpr (kChunks > 0)
    for (int c = 0; c < kChunks; ++c) qv[c] = _mm512_maskz_loadu_ps(masks[c], q + 16 * c);
  const int64_t bytes = kCache == DType::kF32 ? 4 : 2;
  for (int64_t i = 0; i < n; i += 4) {
    __m512 acc[4];
    for (int r = 0; r < 4; ++r) {
      const int64_t row = base + slot(i + r < n ? i + r : i) * D;
      if (i + r + kPrefetchKeys < n) {
        const char* ahead = static_cast<const char*>(p.k_cache) + (base + slot(i + r + kPrefetchKeys) * D) * bytes;
        for (int64_t line = 0; line < D * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
      acc[r] = _mm512_setzero_ps();
      for (int c = 0; c < chunks; ++c) {
        const __m512 qc = kChunks > 0 ? qv[kChunks > 0 ? c : 0] : _mm512_maskz_loadu_ps(masks[c], q + 16 * c);
        acc[r] = _mm512_fmadd_ps(qc, load16<kCache>(p.k_cache, row + 16 * c, masks[c]), acc[r]);
      }
    }
    alignas(16) float four[4];
    _mm_store_ps(four, reduce16x4(acc[0], acc[1], acc[2], acc[3]));
    for (int r = 0; r < 4 && i + r < n; ++r) scores[i + r] = four[r] * p.scale;
  }
}

template <DType kCache>
inline void attend_query(const AttentionProblem& p, int64_t b, int64_t t, int64_t h, float* scores, int64_t* keys) {
  const int64_t D = p.head_dim;
  const int64_t g = h / (p.heads / p.kv_heads);
  const int64_t start = p.start[b];
  const float* q = p.q + ((b * p.tokens + t) * p.heads + h) * D;
  float* out = p.out + ((b * p.tokens + t) * p.heads + h) * D;
  const int64_t base = (b * p.kv_heads + g) * p.capacity * D;
  const int64_t n = attention_keys(p, b, t, keys);
  auto slot = [&](int64_t i) { return i < start ? i : keys[i - start]; };
  const int chunks = static_cast<int>((D + 15) / 16);
  switch (chunks) {
    case 1: key_scores<kCache, 1>(p, q, base, n, slot, scores); break;
    case 2: key_scores<kCache, 2>(p, q, base, n, slot, scores); break;
    case 3: key_scores<kCache, 3>(p, q, base, n, slot, scores); break;
    case 4: key_scores<kCache, 4>(p, q, base, n, slot, scores); break;
    case 5: key_scores<kCache, 5>(p, q, base, n, slot, scores); break;
    case 6: key_scores<kCache, 6>(p, q, base, n, slot, scores); break;
    case 7: key_scores<kCache, 7>(p, q, base, n, slot, scores); break;
    case 8: key_scores<kCache, 8>(p, q, base, n, slot, scores); break;
    default: key_scores<kCache, 0>(p, q, base, n, slot, scores);
  }
  __mmask16 masks[kMaxChunks];
  for (int c = 0; c < chunks; ++c) masks[c] = lanes_mask(D - 16 * c);
  float top = -__builtin_inff();
  for (int64_t i = 0; i < n; ++i) top = scores[i] > top ? scores[i] : top;
  // p_i = exp(s_i - top) and their sum in 16 lanes by list index (attention.h's order)
  float lanes[kAttentionLanes] = {};
  int64_t i = 0;
  for (; i + kAttentionLanes <= n; i += kAttentionLanes)
    for (int l = 0; l < kAttentionLanes; ++l) {
      scores[i + l] = exp_nonpositive(scores[i + l] - top);
      lanes[l] += scores[i + l];
    }
  for (int l = 0; i + l < n; ++l) {
    scores[i + l] = exp_nonpositive(scores[i + l] - top);
    lanes[l] += scores[i + l];
  }
  const float inv = n > 0 ? 1.0f / fold_sum<kAttentionLanes>(lanes) : 0.0f;
  // out = sum_j p_j V[slot(j)] / sum_j p_j, in list order, 64 dimensions (4 registers) at a time
  for (int c0 = 0; c0 < chunks; c0 += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __mmask16 m4[4];
    for (int c = 0; c < 4; ++c) m4[c] = c0 + c < chunks ? masks[c0 + c] : static_cast<__mmask16>(0);
    const int64_t bytes = kCache == DType::kF32 ? 4 : 2;
    for (int64_t j = 0; j < n; ++j) {
      const __m512 pj = _mm512_set1_ps(scores[j]);
      const int64_t row = base + slot(j) * D + 16 * c0;
      if (j + kPrefetchKeys < n) {
        const char* ahead = static_cast<const char*>(p.v_cache) + (base + slot(j + kPrefetchKeys) * D + 16 * c0) * bytes;
        for (int64_t line = 0; line < 64 * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
      for (int c = 0; c < 4; ++c) acc[c] = _mm512_fmadd_ps(pj, load16<kCache>(p.v_cache, row + 16 * c, m4[c]), acc[c]);
    }
    const __m512 scale = _mm512_set1_ps(inv);
    for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(out + 16 * (c0 + c), m4[c], _mm512_mul_ps(acc[c], scale));
  }
}

inline void attend_range(const AttentionProblem& p, int64_t begin, int64_t end, float* scratch, int64_t* keys) {
  for (int64_t task = begin; task < end; ++task) {
    const int64_t h = task % p.heads, bt = task / p.heads;
    const int64_t b = bt / p.tokens, t = bt % p.tokens;
    with_dtype(p.cache_type, [&](auto type) { attend_query<decltype(type)::value>(p, b, t, h, scratch, keys); });
  }
}

}  // namespace specdec::cpu::avx512
SPECDEC_END_TARGET
#endif
