// What the cache attention kernels (attention.h) read and write, and the key order they share.
#pragma once
#include <cstdint>

#include "numeric.h"

namespace specdec::cpu {

constexpr int64_t kMaxAttentionHeadDim = 512;
constexpr int64_t kAttentionQueryBlock = 4;  // tokens of one (row, head) a task takes (they share the keys' loads)

struct AttentionProblem {
  const float* q;          // [B, T, H, D] contiguous
  const void* k_cache;     // [Bc, Hk, capacity, D] contiguous (batch row b reads cache row cache_row(b))
  const void* v_cache;
  DType cache_type;
  const int64_t* start;    // [B] first slot of the block; start[b] + T <= capacity
  const uint8_t* visible;  // [B, T, T] or null (causal)
  int64_t batch, tokens, heads, kv_heads, head_dim, capacity;
  float scale;
  float* out;              // [B, T, H, D] contiguous
  const int64_t* rows = nullptr;  // [B] the cache row batch row b reads, or null: row b

  int64_t cache_row(int64_t b) const { return rows != nullptr ? rows[b] : b; }
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

// A task: tokens t0 .. t0 + queries - 1 (at most kAttentionQueryBlock) of row b, head h. Tasks are
// numbered (b, h, token block) with the block fastest; a pass has attention_num_tasks of them.
struct AttentionTask {
  int64_t b, h, t0, queries;
};

inline int64_t attention_num_tasks(const AttentionProblem& p) {
  return p.batch * p.heads * ((p.tokens + kAttentionQueryBlock - 1) / kAttentionQueryBlock);
}

inline AttentionTask attention_task(const AttentionProblem& p, int64_t index) {
  const int64_t blocks = (p.tokens + kAttentionQueryBlock - 1) / kAttentionQueryBlock;
  const int64_t block = index % blocks, bh = index / blocks;
  const int64_t t0 = block * kAttentionQueryBlock;
  const int64_t queries = p.tokens - t0 < kAttentionQueryBlock ? p.tokens - t0 : kAttentionQueryBlock;
  return {bh / p.heads, bh % p.heads, t0, queries};
}

// The scratch a task needs: floats for its queries' scores (longest_start: the largest start[b]) and
// key-list entries.
inline int64_t attention_scratch_floats(int64_t longest_start, int64_t tokens) {
  return kAttentionQueryBlock * (longest_start + tokens);
}
inline int64_t attention_scratch_keys(int64_t tokens) { return kAttentionQueryBlock * tokens; }

}  // namespace specdec::cpu
