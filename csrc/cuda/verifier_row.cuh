// Block-wide pieces of a verifier row shared by chain_decide_kernel (sampling.cuh) and
// tree_verify_kernel (tree.cuh): the CUDA counterpart of cpu/verifier_row.h. No torch includes.
#pragma once
#include <cstdint>

#include "../common/op_views.h"
#include "../common/sampling_math.h"

namespace specdec::cuda {

// The status checks that follow validate_filter() and the caller's structure check, in the
// contract's order: the draws (missing for a sampling row, or a uniform outside [0, 1)), then the
// token ids of the first n slots. Called by every thread of the block; every thread gets the result.
template <int kThreads>
__device__ int32_t block_draws_and_ids_status(const VerifierView& v, int64_t row, const FilterParams& filter,
                                              int64_t n) {
  int32_t status = v.sampling.missing_draws_status(filter);
  if (status == 0 && v.sampling.has_draws()) {
    bool bad = false;
    for (int64_t c = threadIdx.x; c <= v.drafts; c += kThreads) bad |= !is_valid_uniform(v.sampling.draw(row, c));
    if (__syncthreads_or(bad)) status = kStatusInvalidUniform;
  }
  if (status == 0) {  // every drafted token is checked before any logits are read
    bool bad = false;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) {
      const int64_t x = v.token_ids[row * v.drafts + i];
      bad |= x < 0 || x >= v.vocab;
    }
    if (__syncthreads_or(bad)) status = kStatusDraftTokenOutOfRange;
  }
  return status;
}

}  // namespace specdec::cuda
