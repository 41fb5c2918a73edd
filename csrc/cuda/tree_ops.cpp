// CUDA backend of the tree family (contract in ../tree.h, kernels in tree.cuh, their launches in
// tree.cu): the shared checks, a device guard, the current stream, no host
// synchronisation (invalid rows report a RowStatus in depth / num_accepted), outputs written in
// place, so both ops can be captured in a CUDA graph. tree_verify's fp32 workspace comes from the
// caching allocator (a graph's private pool under capture), ordered on the current stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../tree.h"
#include "launches.h"

namespace specdec::cuda {
namespace {

void build_tree_mask(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes, at::Tensor& mask,
                     at::Tensor& depth) {
  const TreeMaskView view = tree_mask_view(parents, num_nodes, mask, depth);
  SPECDEC_CHECK(view.batch <= INT32_MAX, "build_tree_mask: too many rows for the CUDA kernel (", view.batch, ")");
  const c10::cuda::CUDAGuard guard(parents.device());
  launch_build_tree_mask(view, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void tree_verify(const TreeVerifyArgs& args) {
  const at::Tensor& logits = args.verifier.target_logits;
  const TreeVerifyView view = tree_verify_view(args);
  SPECDEC_CHECK(tree_verify_fits(view), "tree_verify: target_logits is too large for the CUDA kernel (shape ",
                shape_str(logits.sizes()), ")");
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor workspace = at::empty({tree_verify_workspace_floats(view)}, logits.options().dtype(at::kFloat));
  float* ws = workspace.data_ptr<float>();
  SPECDEC_CHECK(reinterpret_cast<uintptr_t>(ws) % kTreeWorkspaceAlignBytes == 0,
                "tree_verify: the workspace is not 32-byte aligned");
  launch_tree_verify(view, ws, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CUDA, m) { register_tree_ops<build_tree_mask, tree_verify>(m); }

}  // namespace specdec::cuda
