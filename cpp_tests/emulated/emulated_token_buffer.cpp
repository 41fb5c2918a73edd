// The token buffer kernel under the emulator (emulated_kernels.h).
#include <cuda_emu.h>

#include "cuda/token_buffer.cu"  // the launches of the CUDA build, compiled here
#include "emulated_kernels.h"

namespace specdec::emulated {

std::string commit_tokens(const CommitTokensView& view) {
  return cuda_emu::errors_of([&] { cuda::launch_commit_tokens(view, nullptr); });
}

}  // namespace specdec::emulated
