// CUDA backend of the sampling family (contract in ../sampling.h, kernels in sampling.cuh, their
// launches in sampling.cu): the shared checks, a device guard, the current stream, no host
// synchronisation (invalid rows report a RowStatus in num_accepted), so every op can be captured
// in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../sampling.h"
#include "launches.h"

namespace specdec::cuda {
namespace {

void chain_verify(const ChainVerifyArgs& args) {
  const ChainVerifyView view = verifier_view(args);
  SPECDEC_CHECK(chain_verify_fits(view), "chain_verify: target_logits is too large for the CUDA kernels (shape ",
                shape_str(args.target_logits.sizes()), ")");
  const c10::cuda::CUDAGuard guard(args.target_logits.device());
  // The per-chunk statistics come from the caching allocator (a graph's private pool under capture),
  // ordered on the current stream.
  const at::Tensor workspace = at::empty({static_cast<int64_t>(chain_verify_workspace_bytes(view))},
                                         args.target_logits.options().dtype(at::kByte));
  launch_chain_verify(view, workspace.data_ptr(), c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void sample_filtered(const SampleFilteredArgs& args) {
  const SampleFilteredView view = sample_filtered_view(args);
  SPECDEC_CHECK(view.batch <= INT32_MAX && view.vocab < INT32_MAX,
                "sample_filtered: logits is too large for the CUDA kernel (shape ", shape_str(args.logits.sizes()), ")");
  const c10::cuda::CUDAGuard guard(args.logits.device());
  launch_sample_filtered(view, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void residual_probs(const at::Tensor& target_probs, const at::Tensor& draft_probs, at::Tensor& out) {
  const ResidualProbsView view = residual_probs_view(target_probs, draft_probs, out);
  SPECDEC_CHECK(view.rows <= INT32_MAX, "residual_probs: too many rows for the CUDA kernel (", view.rows, ")");
  const c10::cuda::CUDAGuard guard(target_probs.device());
  launch_residual_probs(view, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void philox_uniforms(const at::Tensor& seed, const at::Tensor& offset, at::Tensor& out) {
  const PhiloxUniformsView view = philox_uniforms_view(seed, offset, out);
  SPECDEC_CHECK(philox_blocks(view) <= INT32_MAX, "philox_uniforms: too many draws for the CUDA kernel (",
                view.rows * view.columns, ")");
  const c10::cuda::CUDAGuard guard(out.device());
  launch_philox_uniforms(view, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CUDA, m) {
  register_sampling_ops<chain_verify, residual_probs, philox_uniforms, sample_filtered>(m);
}

}  // namespace specdec::cuda
