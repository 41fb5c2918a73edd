// CUDA kernel of the token buffer family (contract in ../token_buffer.h). No torch includes.
#pragma once
#include <cstdint>

#include "../common/op_views.h"
#include "../common/token_commit.h"

namespace specdec::cuda {

constexpr int kCommitThreads = 128;

// One thread per row: a row commits a handful of tokens (w <= the draft slots + 1), and rows are
// independent.
__global__ void commit_tokens_kernel(CommitTokensView v) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < v.batch) commit_row(v, b);
}

}  // namespace specdec::cuda
