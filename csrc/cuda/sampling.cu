// CUDA backend of the sampling family (contract in ../sampling.h, kernels and their design in
// sampling.cuh): the same checks as the CPU backend, a device guard, the current stream, no host
// synchronisation (invalid rows report a RowStatus in num_accepted), so every op can be captured
// in a CUDA graph.
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

#include "../sampling.h"
#include "sampling.cuh"

namespace specdec::cuda {
namespace {

// The CUDA element type with the layout of a torch scalar type.
template <typename scalar_t>
struct DeviceType;
template <>
struct DeviceType<float> {
  using type = float;
};
template <>
struct DeviceType<c10::BFloat16> {
  using type = __nv_bfloat16;
};
template <>
struct DeviceType<c10::Half> {
  using type = __half;
};

template <typename T>
const T* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

template <typename scalar_t>
void launch_chain_verify(const ChainVerifyArgs& a, RowStats* stats, int64_t num_chunks,
                         cudaStream_t stream) {
  using T = typename DeviceType<scalar_t>::type;
  ChainVerifyParams<T> p;
  p.logits = reinterpret_cast<const T*>(a.target_logits.data_ptr<scalar_t>());
  p.draft_ids = a.draft_token_ids.data_ptr<int64_t>();
  p.draft_probs = data_or_null<float>(a.draft_probs);
  p.num_draft = data_or_null<int32_t>(a.num_draft);
  p.temperature = data_or_null<float>(a.temperature);
  p.top_k = data_or_null<int32_t>(a.top_k);
  p.top_p = data_or_null<float>(a.top_p);
  p.seed = data_or_null<int64_t>(a.seed);
  p.offset = data_or_null<int64_t>(a.offset);
  p.uniforms = data_or_null<float>(a.uniforms);
  p.tokens = a.tokens.data_ptr<int64_t>();
  p.num_accepted = a.num_accepted.data_ptr<int32_t>();
  p.stats = stats;
  p.batch = a.target_logits.size(0);
  p.k = a.target_logits.size(1) - 1;
  p.vocab = a.target_logits.size(2);
  p.num_chunks = num_chunks;

  const int64_t stats_blocks = p.batch * (p.k + 1) * num_chunks;
  chain_stats_kernel<T><<<static_cast<unsigned>(stats_blocks), kStatsThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  chain_decide_kernel<T><<<static_cast<unsigned>(p.batch), kDecideThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void chain_verify(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                  const std::optional<at::Tensor>& draft_probs,
                  const std::optional<at::Tensor>& num_draft,
                  const std::optional<at::Tensor>& temperature,
                  const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                  const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                  const std::optional<at::Tensor>& uniforms, at::Tensor& tokens,
                  at::Tensor& num_accepted) {
  const ChainVerifyArgs args{target_logits, draft_token_ids, draft_probs, num_draft, temperature,
                             top_k,         top_p,           seed,        offset,    uniforms,
                             tokens,        num_accepted};
  check_chain_verify(args);
  const int64_t batch = target_logits.size(0);
  if (batch == 0) return;
  const int64_t positions = target_logits.size(1);
  const int64_t num_chunks = stats_chunks(target_logits.size(2));
  TORCH_CHECK(target_logits.size(2) < std::numeric_limits<int32_t>::max() &&
                  batch * positions * num_chunks <= std::numeric_limits<int32_t>::max(),
              "chain_verify: target_logits is too large for the CUDA kernels (shape ",
              shape_str(target_logits.sizes()), ")");
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // Per-chunk statistics of every position; comes from the caching allocator (a graph's private
  // pool under capture), ordered on this stream.
  const at::Tensor workspace = at::empty(
      {static_cast<int64_t>(batch * positions * num_chunks * sizeof(RowStats))},
      target_logits.options().dtype(at::kByte));
  RowStats* stats = reinterpret_cast<RowStats*>(workspace.data_ptr());
  AT_DISPATCH_SWITCH(target_logits.scalar_type(), "chain_verify_cuda",
                     AT_DISPATCH_CASE(at::kFloat, [&] {
                       launch_chain_verify<scalar_t>(args, stats, num_chunks, stream);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       launch_chain_verify<scalar_t>(args, stats, num_chunks, stream);
                     }) AT_DISPATCH_CASE(at::kHalf, [&] {
                       launch_chain_verify<scalar_t>(args, stats, num_chunks, stream);
                     }));
}

void residual_probs(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                    at::Tensor& out) {
  check_residual_probs(target_probs, draft_probs, out);
  const int64_t vocab = target_probs.size(-1);
  const int64_t rows = target_probs.numel() / vocab;
  if (rows == 0) return;
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(),
              "residual_probs: too many rows for the CUDA kernel (", rows, ")");
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_SWITCH(
      target_probs.scalar_type(), "residual_probs_cuda",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        using T = DeviceType<scalar_t>::type;
        residual_probs_kernel<T><<<static_cast<unsigned>(rows), kResidualThreads, 0, stream>>>(
            reinterpret_cast<const T*>(target_probs.data_ptr<scalar_t>()),
            reinterpret_cast<const T*>(draft_probs.data_ptr<scalar_t>()), out.data_ptr<float>(),
            vocab);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
        using T = DeviceType<scalar_t>::type;
        residual_probs_kernel<T><<<static_cast<unsigned>(rows), kResidualThreads, 0, stream>>>(
            reinterpret_cast<const T*>(target_probs.data_ptr<scalar_t>()),
            reinterpret_cast<const T*>(draft_probs.data_ptr<scalar_t>()), out.data_ptr<float>(),
            vocab);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }) AT_DISPATCH_CASE(at::kHalf, [&] {
        using T = DeviceType<scalar_t>::type;
        residual_probs_kernel<T><<<static_cast<unsigned>(rows), kResidualThreads, 0, stream>>>(
            reinterpret_cast<const T*>(target_probs.data_ptr<scalar_t>()),
            reinterpret_cast<const T*>(draft_probs.data_ptr<scalar_t>()), out.data_ptr<float>(),
            vocab);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }));
}

void philox_uniforms(const at::Tensor& seed, const at::Tensor& offset, at::Tensor& out) {
  check_philox_uniforms(seed, offset, out);
  const int64_t rows = out.size(0), columns = out.size(1);
  const int64_t total = rows * columns;
  if (total == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = (total + kPhiloxThreads - 1) / kPhiloxThreads;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(),
              "philox_uniforms: too many draws for the CUDA kernel (", total, ")");
  philox_uniforms_kernel<<<static_cast<unsigned>(blocks), kPhiloxThreads, 0, stream>>>(
      seed.data_ptr<int64_t>(), offset.data_ptr<int64_t>(), out.data_ptr<float>(), rows, columns);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CUDA, m) {
  m.impl("chain_verify", &chain_verify);
  m.impl("residual_probs", &residual_probs);
  m.impl("philox_uniforms", &philox_uniforms);
}

}  // namespace specdec::cuda
