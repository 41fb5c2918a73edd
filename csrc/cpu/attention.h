// Attention of a short block of queries over a contiguous per-row KV cache (no torch). Row b's
// block of T tokens was written at cache slots start[b] .. start[b] + T - 1; query (b, t) sees the
// prefix (slots < start[b]) and the block tokens j it may see: j <= t for a chain, visible[b, t, j] for a
// tree (the root and its ancestors). Grouped-query heads share the kv head h / (H / Hk).
//
// Batch invariance: a query's keys are listed in slot order (prefix, then its visible block tokens)
// and every sum runs over that list in a fixed order (scores, the softmax denominator in the path's lanes
// by list index, the weighted values in list order), so a token's output is the same whether its
// prefix was committed or is part of this block: a tree node sees exactly the keys, in the same
// order, that it sees once its path is committed.
//
// The kernel is simd/attention_impl.inc, compiled once per instruction-set path by that path's file
// (simd/paths.h).
#pragma once
#include <cstdint>

#include "attention_types.h"
#include "isa.h"
#include "simd/paths.h"

namespace specdec::cpu {

// Tasks [begin, end) of the attention_num_tasks(p) (row, head, token block) tasks, on one path. scratch
// holds attention_scratch_floats(max(start), T) floats and keys attention_scratch_keys(T) entries.
inline void cache_attention_range(Isa isa, const AttentionProblem& p, int64_t begin, int64_t end, float* scratch,
                                  int64_t* keys) {
  switch (isa) {
#if SPECDEC_HAVE_X86_PATHS
    case Isa::kAmxBf16:  // (AMX is for the GEMMs only: small_gemm.h)
    case Isa::kAvx512Bf16:
      return avx512::attend_range(p, begin, end, scratch, keys);
    case Isa::kAvx2:
      return avx2::attend_range(p, begin, end, scratch, keys);
#endif
#if SPECDEC_HAVE_NEON_PATH
    case Isa::kNeon:
      return neon::attend_range(p, begin, end, scratch, keys);
#endif
    default:
      return portable::attend_range(p, begin, end, scratch, keys);
  }
}

}  // namespace specdec::cpu
