// CUDA backend of the paged KV cache family (contract in ../kv_cache.h, kernels in kv_cache.cuh,
// their launches in kv_cache.cu): checks, current stream, launch. No host
// synchronisation: invalid slots/positions are skipped on the device.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../kv_cache.h"
#include "launches.h"

namespace specdec::cuda {
namespace {

void kv_write(const KvWriteView& view, const at::Tensor& kv_cache) {
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  launch_kv_write(view, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void kv_compact(const KvCompactView& view, const at::Tensor& kv_cache) {
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  launch_kv_compact(view, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CUDA, m) { register_kv_cache_ops<kv_write, kv_compact>(m); }

}  // namespace specdec::cuda
