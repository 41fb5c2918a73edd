// Rotary embedding of a pass's queries and keys, fused with the write of its keys and values into
// a contiguous per-row cache (no torch). Rows are independent; the caller splits them between threads.
//
// HF's default RoPE with cos = cat(c, c) and rotate_half(x) = cat(-x2, x1) over the halves x1, x2 of
// a head: x1' = x1 c - x2 s, x2' = x2 c + x1 s, in fp32 with fp32 tables c, s [positions, D/2]
// (the model's attention_scaling already folded in).
#pragma once
#include <cstdint>

#include "numeric.h"

namespace specdec::cpu {

struct RopeCacheProblem {
  float* q;                 // [M, H, D], row stride q_row (heads contiguous)
  int64_t q_row;
  const float* k;           // [M, Hk, D], row stride k_row
  int64_t k_row;
  const float* v;           // [M, Hk, D], row stride v_row
  int64_t v_row;
  int64_t heads, kv_heads, head_dim;
  const float* cos;         // [P, D/2]
  const float* sin;         // [P, D/2]
  const int64_t* positions;        // [M] rotary position of each row, < P
  const int64_t* cache_rows;       // [M] cache row (batch row) of each token
  const int64_t* cache_positions;  // [M] cache slot of each token
  void* k_cache;            // [Bc, Hk, capacity, D] contiguous
  void* v_cache;
  DType cache_type;
  int64_t capacity;
};

inline void rotate_head(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * c[i] - x2 * s[i];
    x[i + half] = x2 * c[i] + x1 * s[i];
  }
}

template <DType kCache>
inline void rope_cache_rows_typed(const RopeCacheProblem& p, int64_t begin, int64_t end) {
  const int64_t D = p.head_dim, half = D / 2;
  float rotated[512];  // one key head (head_dim <= 512, checked by the op)
  for (int64_t r = begin; r < end; ++r) {
    const float* c = p.cos + p.positions[r] * half;
    const float* s = p.sin + p.positions[r] * half;
    for (int64_t h = 0; h < p.heads; ++h) rotate_head(p.q + r * p.q_row + h * D, c, s, half);
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      const float* k = p.k + r * p.k_row + g * D;
      const float* v = p.v + r * p.v_row + g * D;
      for (int64_t i = 0; i < D; ++i) rotated[i] = k[i];
      rotate_head(rotated, c, s, half);
      const int64_t slot = ((p.cache_rows[r] * p.kv_heads + g) * p.capacity + p.cache_positions[r]) * D;
      for (int64_t i = 0; i < D; ++i) {
        store_from_float<kCache>(p.k_cache, slot + i, rotated[i]);
        store_from_float<kCache>(p.v_cache, slot + i, v[i]);
      }
    }
  }
}

// Rows [begin, end): q rotated in place; k rotated and v copied into their cache slots (rounded to
// the cache's dtype).
inline void rope_cache_rows(const RopeCacheProblem& p, int64_t begin, int64_t end) {
  with_dtype(p.cache_type, [&](auto type) { rope_cache_rows_typed<decltype(type)::value>(p, begin, end); });
}

}  // namespace specdec::cpu
