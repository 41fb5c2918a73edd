// Host side of the token buffer kernel, from the op's raw view (common/op_views.h). No torch includes:
// the torch wrapper (token_buffer.cu) and the emulated-kernel tests (cpp_tests/emulated) run this code.
#pragma once
#include <cstdint>

#include "../common/op_views.h"
#include "launch.cuh"
#include "token_buffer.cuh"

namespace specdec::cuda {

inline void launch_commit_tokens(const CommitTokensView& v, cudaStream_t stream) {
  launch_kernel(commit_tokens_kernel, grid_of((v.batch + kCommitThreads - 1) / kCommitThreads), dim3(kCommitThreads),
                stream, v);
}

}  // namespace specdec::cuda
