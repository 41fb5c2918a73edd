// CUDA backend of the token buffer family (contract in ../token_buffer.h, kernel in token_buffer.cuh,
// its launch in token_buffer.cu): checks, current stream, launch. No host synchronisation.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../token_buffer.h"
#include "launches.h"

namespace specdec::cuda {
namespace {

void commit_tokens(const CommitTokensView& view, const at::Tensor& token_buffer) {
  const c10::cuda::CUDAGuard guard(token_buffer.device());
  launch_commit_tokens(view, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CUDA, m) { register_token_buffer_ops<commit_tokens>(m); }

}  // namespace specdec::cuda
