// The tree family's kernels under the emulator (emulated_kernels.h).
#include <cuda_emu.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "cuda/tree.cu"  // the launches of the CUDA build, compiled here
#include "emulated_kernels.h"

namespace specdec::emulated {

std::string build_tree_mask(const TreeMaskView& view) {
  return cuda_emu::errors_of([&] { cuda::launch_build_tree_mask(view, nullptr); });
}

std::string tree_verify(const TreeVerifyView& view) {
  const size_t bytes = static_cast<size_t>(cuda::tree_verify_workspace_floats(view)) * sizeof(float);
  const size_t align = cuda::kTreeWorkspaceAlignBytes;
  const std::unique_ptr<void, decltype(&std::free)> workspace(std::aligned_alloc(align, (bytes / align + 1) * align),
                                                              &std::free);
  std::memset(workspace.get(), 0xFF, bytes);  // NaN weights until the kernel writes them
  float* buffers = static_cast<float*>(workspace.get());
  return cuda_emu::errors_of([&] { cuda::launch_tree_verify(view, buffers, nullptr); });
}

}  // namespace specdec::emulated
