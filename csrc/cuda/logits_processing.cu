// The host side of process_logits's kernels (logits_processing.cuh): the entry points that launches.h
// declares. No torch: nvcc compiles this file with the kernels alone, and the torch wrapper
// (logits_processing_ops.cpp) is the host compiler's; the emulated-kernel tests (cpp_tests/emulated)
// compile this same file under the CPU emulator.
#include <algorithm>
#include <cstdint>

#include "../logits_processing.h"
#include "launch.cuh"
#include "launches.h"
#include "logits_processing.cuh"

namespace specdec::cuda {

static int64_t process_logits_blocks(const ProcessLogitsView& v) { return v.batch * v.positions(); }

bool process_logits_fits(const ProcessLogitsView& v) {
  return v.drafts <= kMaxProcessDrafts && process_logits_blocks(v) <= INT32_MAX && v.vocab < INT32_MAX;
}

void launch_process_logits_check(const ProcessLogitsView& v, int32_t* errors, cudaStream_t stream) {
  launch_kernel(process_logits_check_kernel, dim3(1), dim3(kCheckThreads), stream, v, errors);
  if ((v.output_counts == nullptr && v.logit_bias == nullptr) || v.batch * v.vocab == 0) return;
  constexpr int64_t kEntriesPerThread = 16, kMaxBlocks = 1024;  // (a [16, 128k] table: 512 blocks)
  const int64_t per_block = kCheckThreads * kEntriesPerThread;
  const int64_t blocks = std::min<int64_t>((v.batch * v.vocab + per_block - 1) / per_block, kMaxBlocks);
  launch_kernel(process_logits_tables_check_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kCheckThreads), stream,
                v, errors);
}

void launch_process_logits(const ProcessLogitsView& v, cudaStream_t stream) {
  with_device_type(v.logits_type, [&](auto type) {
    using T = typename decltype(type)::type;
    launch_kernel(process_logits_kernel<T>, grid_of(process_logits_blocks(v)), dim3(kProcessThreads), stream, v);
  });
}

}  // namespace specdec::cuda
