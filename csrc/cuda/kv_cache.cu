// CUDA backend of the paged KV cache family (contract in ../kv_cache.h): checks, current stream,
// launch. No host synchronisation: invalid slots/positions are skipped on the device.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "../kv_cache.h"
#include "kv_cache.cuh"

namespace specdec::cuda {
namespace {

int threads_for(int64_t elems) {
  int threads = 32;
  while (threads < 256 && threads < elems) threads *= 2;
  return threads;
}

template <typename word_t>
void launch_kv_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
                     at::Tensor& kv_cache, cudaStream_t stream) {
  const int64_t batch = key.size(0), tokens = key.size(1);
  const int64_t heads = key.size(2), head_dim = key.size(3);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  kv_write_kernel<word_t><<<batch * tokens, threads_for(heads * head_dim), 0, stream>>>(
      static_cast<const word_t*>(key.data_ptr()), static_cast<const word_t*>(value.data_ptr()),
      slot_mapping.data_ptr<int64_t>(), static_cast<word_t*>(kv_cache.data_ptr()), tokens, heads,
      head_dim, key.stride(0), key.stride(1), key.stride(2), key.stride(3), value.stride(0),
      value.stride(1), value.stride(2), value.stride(3), num_slots);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void kv_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping,
              at::Tensor& kv_cache) {
  check_kv_write(key, value, slot_mapping, kv_cache);
  if (key.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (kv_cache.element_size() == 4) {
    launch_kv_write<uint32_t>(key, value, slot_mapping, kv_cache, stream);
  } else {
    launch_kv_write<uint16_t>(key, value, slot_mapping, kv_cache, stream);
  }
}

template <typename word_t>
void launch_kv_compact(at::Tensor& kv_cache, const at::Tensor& block_tables,
                       const at::Tensor& src_positions, const at::Tensor& dst_start,
                       cudaStream_t stream) {
  const int64_t planes = kv_cache.size(0);
  const int64_t slot_elems = kv_cache.size(3) * kv_cache.size(4);
  const int64_t batch = block_tables.size(0);
  kv_compact_kernel<word_t><<<batch * planes, threads_for(slot_elems), 0, stream>>>(
      static_cast<word_t*>(kv_cache.data_ptr()), block_tables.data_ptr<int32_t>(),
      src_positions.data_ptr<int64_t>(), dst_start.data_ptr<int64_t>(), planes, kv_cache.size(1),
      kv_cache.size(2), slot_elems, block_tables.size(1), src_positions.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void kv_compact(at::Tensor& kv_cache, const at::Tensor& block_tables,
                const at::Tensor& src_positions, const at::Tensor& dst_start) {
  check_kv_compact(kv_cache, block_tables, src_positions, dst_start);
  if (kv_cache.numel() == 0 || src_positions.numel() == 0 || block_tables.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (kv_cache.element_size() == 4) {
    launch_kv_compact<uint32_t>(kv_cache, block_tables, src_positions, dst_start, stream);
  } else {
    launch_kv_compact<uint16_t>(kv_cache, block_tables, src_positions, dst_start, stream);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CUDA, m) {
  m.impl("kv_write", &kv_write);
  m.impl("kv_compact", &kv_compact);
}

}  // namespace specdec::cuda
