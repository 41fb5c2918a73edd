// The paged KV cache kernels under the emulator (emulated_kernels.h).
#include <cuda_emu.h>

#include "cuda/kv_cache.cu"  // the launches of the CUDA build, compiled here
#include "emulated_kernels.h"

namespace specdec::emulated {

std::string kv_write(const KvWriteView& view) {
  return cuda_emu::errors_of([&] { cuda::launch_kv_write(view, nullptr); });
}

std::string kv_compact(const KvCompactView& view) {
  return cuda_emu::errors_of([&] { cuda::launch_kv_compact(view, nullptr); });
}

}  // namespace specdec::emulated
