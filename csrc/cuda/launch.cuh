// The seam between the host-side launch code (cuda/<family>.cu) and whatever runs the kernels:
// launch_kernel() is the triple-chevron launch under nvcc, and the CPU emulator's own launcher in
// the emulated-kernel tests (cpp_tests/cuda_emu, which defines SPECDEC_CUDA_EMULATOR), so the same
// grids, parameters and workspace sizes run in both. No torch includes.
#pragma once
#include <cstdint>

#include "../common/op_views.h"

#if defined(SPECDEC_CUDA_EMULATOR)
#include <cuda_emu.h>
#else
#include <cuda_runtime.h>
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace specdec::cuda {

#if defined(SPECDEC_CUDA_EMULATOR)
using ::cuda_emu::launch_kernel;
#else
// Launches kernel<<<grid, block, 0, stream>>>(args...); errors surface at the caller's launch check.
template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args... args) {
  kernel<<<grid, block, 0, stream>>>(args...);
}
#endif

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with the device element type of `type` (float, __half, __nv_bfloat16).
template <typename F>
inline void with_device_type(ElementType type, F&& f) {
  switch (type) {
    case ElementType::kFloat32:
      return f(TypeTag<float>{});
    case ElementType::kFloat16:
      return f(TypeTag<__half>{});
    case ElementType::kBFloat16:
      return f(TypeTag<__nv_bfloat16>{});
  }
}

// Calls f(TypeTag<W>{}) with the unsigned word of word_bytes (2 or 4) that the KV kernels move.
template <typename F>
inline void with_word_type(int32_t word_bytes, F&& f) {
  if (word_bytes == 4) return f(TypeTag<uint32_t>{});
  return f(TypeTag<uint16_t>{});
}

// Blocks of a one-block-per-item grid; the wrappers check that counts fit (< 2^31).
inline dim3 grid_of(int64_t blocks) { return dim3(static_cast<unsigned>(blocks)); }

}  // namespace specdec::cuda
