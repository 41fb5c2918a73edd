// What the cache attention kernels (attention.h) read and write, and the key order they share.
#pragma once
#include <cstdint>

#include "numeric.h"

namespace specdec::cpu {

constexpr int kAttentionLanes = 16;

struct AttentionProblem {
  const float* q;          // [B, T, H, D] contiguous
  const void* k_cache;     // [Bc, Hk, capacity, D] contiguous, Bc >= B (row b reads cache row b)
  const void* v_cache;
  DType cache_type;
  const int64_t* start;    // [B] first slot of the block; start[b] + T <= capacity
  const uint8_t* visible;  // [B, T, T] or null (causal)
  int64_t batch, tokens, heads, kv_heads, head_dim, capacity;
  float scale;
  float* out;              // [B, T, H, D] contiguous
};

// The keys query (b, t) sees, in the order every sum runs: the prefix slots 0 .. start[b] - 1 (not
// listed), then its visible block slots in increasing order, written to keys[0 ..]. Returns the
// number of keys, prefix included.
inline int64_t attention_keys(const AttentionProblem& p, int64_t b, int64_t t, int64_t* keys) {
  const int64_t start = p.start[b];
  int64_t n = start;
  for (int64_t j = 0; j < p.tokens; ++j) {
    const bool seen = p.visible != nullptr ? p.visible[(b * p.tokens + t) * p.tokens + j] != 0 : j <= t;
    if (seen) keys[n++ - start] = start + j;
  }
  return n;
}

}  // namespace specdec::cpu
