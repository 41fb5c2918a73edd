// CUDA backend of the tree family (contract in ../tree.h, kernels and their design in tree.cuh):
// the same checks as the CPU backend, a device guard, the current stream, no host
// synchronisation (invalid rows report a RowStatus in depth / num_accepted), outputs written in
// place, so both ops can be captured in a CUDA graph. tree_verify's fp32 workspace comes from the
// caching allocator (a graph's private pool under capture), ordered on the current stream.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>

#include "../tree.h"
#include "tree.cuh"

namespace specdec::cuda {
namespace {

// The CUDA element type with the layout of a torch scalar type.
template <typename scalar_t>
struct TreeDeviceType;
template <>
struct TreeDeviceType<float> {
  using type = float;
};
template <>
struct TreeDeviceType<c10::BFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct TreeDeviceType<c10::Half> {
  using type = __half;
};

template <typename T>
const T* optional_data(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

void build_tree_mask(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
                     at::Tensor& mask, at::Tensor& depth) {
  check_build_tree_mask(parents, num_nodes, mask, depth);
  const int64_t batch = parents.size(0);
  const int64_t nodes = parents.size(1);
  if (batch == 0 || nodes == 0) return;
  TORCH_CHECK(batch <= std::numeric_limits<int32_t>::max(),
              "build_tree_mask: too many rows for the CUDA kernel (", batch, ")");
  const c10::cuda::CUDAGuard guard(parents.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  build_tree_mask_kernel<<<static_cast<unsigned>(batch), kMaskThreads, 0, stream>>>(
      parents.data_ptr<int32_t>(), optional_data<int32_t>(num_nodes), mask.data_ptr<bool>(),
      depth.data_ptr<int32_t>(), nodes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t>
void launch_tree_verify(const TreeVerifyArgs& a, float* workspace, int64_t stride,
                        int num_buffers, cudaStream_t stream) {
  using T = typename TreeDeviceType<scalar_t>::type;
  TreeVerifyParams<T> p;
  p.logits = reinterpret_cast<const T*>(a.target_logits.data_ptr<scalar_t>());
  p.token_ids = a.tree_token_ids.data_ptr<int64_t>();
  p.parents = a.parents.data_ptr<int32_t>();
  p.draft_probs = optional_data<float>(a.draft_probs);
  p.num_nodes = optional_data<int32_t>(a.num_nodes);
  p.temperature = optional_data<float>(a.temperature);
  p.top_k = optional_data<int32_t>(a.top_k);
  p.top_p = optional_data<float>(a.top_p);
  p.seed = optional_data<int64_t>(a.seed);
  p.offset = optional_data<int64_t>(a.offset);
  p.uniforms = optional_data<float>(a.uniforms);
  p.path = a.path.data_ptr<int32_t>();
  p.tokens = a.tokens.data_ptr<int64_t>();
  p.num_accepted = a.num_accepted.data_ptr<int32_t>();
  p.workspace = workspace;
  p.nodes = a.target_logits.size(1) - 1;
  p.vocab = a.target_logits.size(2);
  p.stride = stride;
  p.num_buffers = num_buffers;
  const int64_t batch = a.target_logits.size(0);
  tree_verify_kernel<T><<<static_cast<unsigned>(batch), kTreeThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void tree_verify(const at::Tensor& target_logits, const at::Tensor& tree_token_ids,
                 const at::Tensor& parents, const std::optional<at::Tensor>& draft_probs,
                 const std::optional<at::Tensor>& num_nodes,
                 const std::optional<at::Tensor>& temperature,
                 const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                 const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                 const std::optional<at::Tensor>& uniforms, at::Tensor& path, at::Tensor& tokens,
                 at::Tensor& num_accepted) {
  const TreeVerifyArgs args{target_logits, tree_token_ids, parents, draft_probs, num_nodes,
                            temperature,   top_k,          top_p,   seed,        offset,
                            uniforms,      path,           tokens,  num_accepted};
  check_tree_verify(args);
  const int64_t batch = target_logits.size(0);
  if (batch == 0) return;
  const int64_t vocab = target_logits.size(2);
  TORCH_CHECK(batch <= std::numeric_limits<int32_t>::max(),
              "tree_verify: too many rows for the CUDA kernel (", batch, ")");
  TORCH_CHECK(vocab <= std::numeric_limits<int32_t>::max() - kTreeBufferAlign,
              "tree_verify: the vocabulary is too large for the CUDA kernel (", vocab, ")");
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // One fp32 row per batch row holds p once a rejection has to update it; the q rule needs a
  // second one (the residual is written beside p, which is kept when the residual mass is 0).
  const int num_buffers = draft_probs.has_value() ? 2 : 1;
  const int64_t stride = (vocab + kTreeBufferAlign - 1) / kTreeBufferAlign * kTreeBufferAlign;
  const at::Tensor workspace =
      at::empty({batch, num_buffers, stride}, target_logits.options().dtype(at::kFloat));
  float* ws = workspace.data_ptr<float>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(ws) % 32 == 0,
              "tree_verify: the workspace is not 32-byte aligned");
  AT_DISPATCH_SWITCH(target_logits.scalar_type(), "tree_verify_cuda",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       launch_tree_verify<scalar_t>(args, ws, stride, num_buffers, stream);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       launch_tree_verify<scalar_t>(args, ws, stride, num_buffers, stream);
                     }) AT_DISPATCH_CASE(at::kHalf, [&] {
                       launch_tree_verify<scalar_t>(args, ws, stride, num_buffers, stream);
                     }));
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CUDA, m) {
  m.impl("build_tree_mask", &build_tree_mask);
  m.impl("tree_verify", &tree_verify);
}

}  // namespace specdec::cuda
