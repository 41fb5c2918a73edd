// The host side of the tree family's kernels (tree.cuh): the entry points that launches.h declares. No
// torch: nvcc compiles this file with the kernels alone, and the torch wrapper (tree_ops.cpp) is the
// host compiler's; the emulated-kernel tests (cpp_tests/emulated) compile this same file under the CPU
// emulator.
#include <cstdint>

#include "../common/op_views.h"
#include "launch.cuh"
#include "launches.h"
#include "tree.cuh"

namespace specdec::cuda {

void launch_build_tree_mask(const TreeMaskView& v, cudaStream_t stream) {
  launch_kernel(build_tree_mask_kernel, grid_of(v.batch), dim3(kMaskThreads), stream, v.parents, v.num_nodes,
                v.mask, v.depth, v.nodes);
}

namespace {

// tree_verify's fp32 workspace: one row of p per batch row once a rejection has to update it, and
// with draft_probs a second one (the residual is written beside p, which is kept when the residual
// mass is 0). Buffers start at multiples of kTreeBufferAlign floats of a kTreeWorkspaceAlignBytes
// aligned base.
struct TreeWorkspace {
  int num_buffers;
  int64_t stride;  // floats per buffer

  explicit TreeWorkspace(const TreeVerifyView& v)
      : num_buffers(v.draft_probs != nullptr ? 2 : 1),
        stride((v.vocab + kTreeBufferAlign - 1) / kTreeBufferAlign * kTreeBufferAlign) {}
  int64_t floats(const TreeVerifyView& v) const { return v.batch * num_buffers * stride; }
};
static_assert(kTreeWorkspaceAlignBytes == kTreeBufferAlign * static_cast<int64_t>(sizeof(float)));

}  // namespace

int64_t tree_verify_workspace_floats(const TreeVerifyView& v) { return TreeWorkspace(v).floats(v); }

bool tree_verify_fits(const TreeVerifyView& v) {
  return v.batch <= INT32_MAX && v.vocab <= INT32_MAX - kTreeBufferAlign;
}

void launch_tree_verify(const TreeVerifyView& v, float* workspace, cudaStream_t stream) {
  const TreeWorkspace layout(v);
  TreeVerifyParams p;
  static_cast<TreeVerifyView&>(p) = v;
  p.workspace = workspace;
  p.stride = layout.stride;
  p.num_buffers = layout.num_buffers;
  with_device_type(v.logits_type, [&](auto type) {
    using T = typename decltype(type)::type;
    launch_kernel(tree_verify_kernel<T>, grid_of(v.batch), dim3(kTreeThreads), stream, p);
  });
}

}  // namespace specdec::cuda
