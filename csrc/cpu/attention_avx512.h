// Cache attention on the AVX-512 path (see attention.h for the contract and the key order). The
// generic loops of attention_impl.inc spend most of their time folding each key's 16 partial sums
// one scalar at a time; here four keys' sums are folded together by gemm_avx512.h's reduce16x4 (the
// same tree per key, so grouping keys does not change a score), the cache rows are widened from
// bf16/fp16 with the GEMM's loads, the softmax runs 16 lanes at a time, and a task's queries (up to
// kAttentionQueryBlock tokens of one head: a verification block) load each prefix key and value once
// for all of them. Measured on the bundled target (6 layers x 8 heads x ~250 keys, bf16, one thread):
// 0.69 ms for a 9-token block with one query per task and a scalar exp.
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

// (SPECDEC_UNROLL, gemm_avx512.h: the loops over queries x keys and queries x chunks below.)

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

// GCC 12's intrinsics start some results from _mm512_undefined_*(), which -Wmaybe-uninitialized
// reports once they are inlined here; the values are fully written.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// exp_nonpositive (vector_math.h) in 16 lanes: the same operations in the same order (no fused
// multiply-adds, as the scalar code is compiled), so a lane gives the scalar function's bits.
inline __m512 exp16_nonpositive(__m512 x) {
  const __m512 min_arg = _mm512_set1_ps(-87.3f);
  const __m512 round_magic = _mm512_set1_ps(12582912.0f);
  const __m512 xc = _mm512_max_ps(x, min_arg);  // NaN -> min_arg (max_ps returns its second operand)
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), round_magic),
                                 round_magic);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 poly = _mm512_set1_ps(1.9875691500e-4f);
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.3981999507e-3f));
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(8.3334519073e-3f));
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(4.1665795894e-2f));
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(1.6666665459e-1f));
  poly = _mm512_add_ps(_mm512_mul_ps(poly, r), _mm512_set1_ps(5.0000001201e-1f));
  const __m512 expm = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(poly, r), r), r), _mm512_set1_ps(1.0f));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 result = _mm512_mul_ps(expm, _mm512_castsi512_ps(exponent));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, min_arg, _CMP_GE_OQ), result);
}

// scores[i] <- exp(scores[i] - max) for i < n, and 1 / their sum, the sum in 16 lanes by list index
// then fold_sum (attention.h's order). 0 when n = 0.
inline float softmax_weights(float* scores, int64_t n) {
  __m512 top16 = _mm512_set1_ps(-__builtin_inff());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) top16 = _mm512_max_ps(_mm512_loadu_ps(scores + i), top16);  // NaN never wins
  if (i < n) top16 = _mm512_mask_max_ps(top16, lanes_mask(n - i), _mm512_maskz_loadu_ps(lanes_mask(n - i), scores + i), top16);
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(top16));
  __m512 sums = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + i), top));
    _mm512_storeu_ps(scores + i, e);
    sums = _mm512_add_ps(sums, e);
  }
  if (i < n) {
    const __mmask16 m = lanes_mask(n - i);
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + i), top));
    _mm512_mask_storeu_ps(scores + i, m, e);
    sums = _mm512_mask_add_ps(sums, m, sums, e);
  }
  alignas(64) float lanes[kAttentionLanes];
  _mm512_store_ps(lanes, sums);
  return n > 0 ? 1.0f / fold_sum<kAttentionLanes>(lanes) : 0.0f;
}

#pragma GCC diagnostic pop

// One query's scores over n listed keys (slot(i) for i < n), by its head's chunk count.
template <DType kCache, typename Slot>
inline void query_scores(const AttentionProblem& p, const float* q, int64_t base, int64_t n, const Slot& slot,
                         float* scores) {
  switch ((p.head_dim + 15) / 16) {
    case 1: return key_scores<kCache, 1>(p, q, base, n, slot, scores);
    case 2: return key_scores<kCache, 2>(p, q, base, n, slot, scores);
    case 3: return key_scores<kCache, 3>(p, q, base, n, slot, scores);
    case 4: return key_scores<kCache, 4>(p, q, base, n, slot, scores);
    case 5: return key_scores<kCache, 5>(p, q, base, n, slot, scores);
    case 6: return key_scores<kCache, 6>(p, q, base, n, slot, scores);
    case 7: return key_scores<kCache, 7>(p, q, base, n, slot, scores);
    case 8: return key_scores<kCache, 8>(p, q, base, n, slot, scores);
    default: return key_scores<kCache, 0>(p, q, base, n, slot, scores);
  }
}

// The scores of kQueries queries of one head against the prefix slots 0 .. n-1, four keys at a time:
// each key chunk is loaded once for all of them. Every (query, key) sum runs over the chunks in
// key_scores' order from zero and is folded by the same reduce16x4, so a query gets the scores
// key_scores gives it alone.
template <DType kCache, int kQueries>
inline void prefix_scores_shared(const AttentionProblem& p, const float* const* qs, int64_t base, int64_t n,
                                 float* const* scores) {
  const int64_t D = p.head_dim;
  const int chunks = static_cast<int>((D + 15) / 16);
  const int64_t bytes = kCache == DType::kF32 ? 4 : 2;
  for (int64_t i = 0; i < n; i += 4) {
    __m512 acc[kQueries][4];
    SPECDEC_UNROLL for (int j = 0; j < kQueries; ++j)
      SPECDEC_UNROLL for (int r = 0; r < 4; ++r) acc[j][r] = _mm512_setzero_ps();
    for (int r = 0; r < 4 && i + r + kPrefetchKeys < n; ++r) {
      const char* ahead = static_cast<const char*>(p.k_cache) + (base + (i + r + kPrefetchKeys) * D) * bytes;
      for (int64_t line = 0; line < D * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    for (int c = 0; c < chunks; ++c) {
      const __mmask16 m = lanes_mask(D - 16 * c);
      __m512 key[4];
      SPECDEC_UNROLL for (int r = 0; r < 4; ++r) key[r] = load16<kCache>(p.k_cache, base + (i + r < n ? i + r : i) * D + 16 * c, m);
      SPECDEC_UNROLL for (int j = 0; j < kQueries; ++j) {
        const __m512 qc = _mm512_maskz_loadu_ps(m, qs[j] + 16 * c);
        SPECDEC_UNROLL for (int r = 0; r < 4; ++r) acc[j][r] = _mm512_fmadd_ps(qc, key[r], acc[j][r]);
      }
    }
    SPECDEC_UNROLL for (int j = 0; j < kQueries; ++j) {
      alignas(16) float four[4];
      _mm_store_ps(four, reduce16x4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
      for (int r = 0; r < 4 && i + r < n; ++r) scores[j][i + r] = four[r] * p.scale;
    }
  }
}

// out_j = sum_i w_j[i] V[slot_j(i)] * inv_j for kQueries queries of one head, each over its list (the
// shared prefix slots 0 .. prefix-1, then its own block slots keys_j), in list order per query: the
// prefix's value rows are loaded once for all of them, 64 dimensions (4 registers) at a time.
template <DType kCache, int kQueries>
inline void weighted_values(const AttentionProblem& p, int64_t base, int64_t prefix, float* const* weights,
                            const int64_t* const* keys, const int64_t* counts, const float* inv, float* const* outs) {
  const int64_t D = p.head_dim;
  const int chunks = static_cast<int>((D + 15) / 16);
  const int64_t bytes = kCache == DType::kF32 ? 4 : 2;
  for (int c0 = 0; c0 < chunks; c0 += 4) {
    __mmask16 m4[4];
    SPECDEC_UNROLL for (int c = 0; c < 4; ++c) m4[c] = c0 + c < chunks ? lanes_mask(D - 16 * (c0 + c)) : static_cast<__mmask16>(0);
    __m512 acc[kQueries][4];
    SPECDEC_UNROLL for (int j = 0; j < kQueries; ++j)
      SPECDEC_UNROLL for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < prefix; ++i) {
      if (i + kPrefetchKeys < prefix) {
        const char* ahead = static_cast<const char*>(p.v_cache) + (base + (i + kPrefetchKeys) * D + 16 * c0) * bytes;
        for (int64_t line = 0; line < 64 * bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      }
      __m512 value[4];
      SPECDEC_UNROLL for (int c = 0; c < 4; ++c) value[c] = load16<kCache>(p.v_cache, base + i * D + 16 * (c0 + c), m4[c]);
      SPECDEC_UNROLL for (int j = 0; j < kQueries; ++j) {
        const __m512 w = _mm512_set1_ps(weights[j][i]);
        SPECDEC_UNROLL for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_fmadd_ps(w, value[c], acc[j][c]);
      }
    }
    SPECDEC_UNROLL for (int j = 0; j < kQueries; ++j) {
      for (int64_t i = prefix; i < counts[j]; ++i) {
        const __m512 w = _mm512_set1_ps(weights[j][i]);
        const int64_t row = base + keys[j][i - prefix] * D + 16 * c0;
        SPECDEC_UNROLL for (int c = 0; c < 4; ++c) acc[j][c] = _mm512_fmadd_ps(w, load16<kCache>(p.v_cache, row + 16 * c, m4[c]), acc[j][c]);
      }
      const __m512 scale = _mm512_set1_ps(inv[j]);
      SPECDEC_UNROLL for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(outs[j] + 16 * (c0 + c), m4[c], _mm512_mul_ps(acc[j][c], scale));
    }
  }
}

// Queries t0 .. t0 + kQueries - 1 of row b, head h (attention_task): the prefix keys are read once for
// all of them; each query's arithmetic is what it gets alone, so a token's output does not depend on
// the block it came in (attention.h).
template <DType kCache, int kQueries>
inline void attend_block(const AttentionProblem& p, int64_t b, int64_t h, int64_t t0, float* scratch, int64_t* keys) {
  const int64_t D = p.head_dim;
  const int64_t g = h / (p.heads / p.kv_heads);
  const int64_t start = p.start[b];
  const int64_t base = (p.cache_row(b) * p.kv_heads + g) * p.capacity * D;
  const float* qs[kQueries];
  float* outs[kQueries];
  float* scores[kQueries];
  const int64_t* lists[kQueries];
  int64_t counts[kQueries];
  float inv[kQueries];
  for (int j = 0; j < kQueries; ++j) {
    const int64_t t = t0 + j;
    qs[j] = p.q + ((b * p.tokens + t) * p.heads + h) * D;
    outs[j] = p.out + ((b * p.tokens + t) * p.heads + h) * D;
    scores[j] = scratch + j * (start + p.tokens);
    int64_t* own = keys + j * p.tokens;
    counts[j] = attention_keys(p, b, t, own);
    lists[j] = own;
  }
  if constexpr (kQueries == 1) {
    query_scores<kCache>(p, qs[0], base, start, [](int64_t i) { return i; }, scores[0]);  // q held in registers
  } else {
    prefix_scores_shared<kCache, kQueries>(p, qs, base, start, scores);
  }
  for (int j = 0; j < kQueries; ++j) {
    const int64_t* own = lists[j];
    query_scores<kCache>(p, qs[j], base, counts[j] - start, [own](int64_t i) { return own[i]; }, scores[j] + start);
    inv[j] = softmax_weights(scores[j], counts[j]);
  }
  weighted_values<kCache, kQueries>(p, base, start, scores, lists, counts, inv, outs);
}

inline void attend_range(const AttentionProblem& p, int64_t begin, int64_t end, float* scratch, int64_t* keys) {
  for (int64_t index = begin; index < end; ++index) {
    const AttentionTask task = attention_task(p, index);
    with_dtype(p.cache_type, [&](auto type) {
      constexpr DType kCache = decltype(type)::value;
      switch (task.queries) {
        case 1: return attend_block<kCache, 1>(p, task.b, task.h, task.t0, scratch, keys);
        case 2: return attend_block<kCache, 2>(p, task.b, task.h, task.t0, scratch, keys);
        case 3: return attend_block<kCache, 3>(p, task.b, task.h, task.t0, scratch, keys);
        default: return attend_block<kCache, 4>(p, task.b, task.h, task.t0, scratch, keys);
      }
    });
  }
}

#undef SPECDEC_UNROLL

}  // namespace specdec::cpu::avx512
SPECDEC_END_TARGET
#endif
