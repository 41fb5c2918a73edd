// The host side of the token buffer kernel (token_buffer.cuh): the entry points that launches.h
// declares. No torch: nvcc compiles this file with the kernels alone, and the torch wrapper
// (token_buffer_ops.cpp) is the host compiler's; the emulated-kernel tests (cpp_tests/emulated)
// compile this same file under the CPU emulator.
#include <cstdint>

#include "../common/op_views.h"
#include "launch.cuh"
#include "launches.h"
#include "token_buffer.cuh"

namespace specdec::cuda {

void launch_commit_tokens(const CommitTokensView& v, cudaStream_t stream) {
  launch_kernel(commit_tokens_kernel, grid_of((v.batch + kCommitThreads - 1) / kCommitThreads), dim3(kCommitThreads),
                stream, v);
}

}  // namespace specdec::cuda
