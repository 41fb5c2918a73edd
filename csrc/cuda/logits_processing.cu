// The host side of process_logits's kernels (kernels in logits_processing.cuh): grids, limits, workspace sizes and
// launches, the entry points of launches.h. No torch: nvcc compiles this file and the kernels
// alone, the torch wrapper (logits_processing_ops.cpp) is the host compiler's; the emulated-kernel tests
// (cpp_tests/emulated) compile this same file under the CPU emulator.
#include <cstdint>

#include "../logits_processing.h"
#include "launch.cuh"
#include "launches.h"
#include "logits_processing.cuh"

namespace specdec::cuda {

inline int64_t process_logits_blocks(const ProcessLogitsView& v) { return v.batch * v.positions(); }

// Whether the kernel holds the view: a column's prefix fits the shared-memory table, and the grid
// (one block per row and column) and the token indices fit 32 bits.
bool process_logits_fits(const ProcessLogitsView& v) {
  return v.drafts <= kMaxProcessDrafts && process_logits_blocks(v) <= INT32_MAX && v.vocab < INT32_MAX;
}

// Or-s row_value_errors over every row into *errors (one int32 on the launch's device).
void launch_process_logits_check(const ProcessLogitsView& v, int32_t* errors, cudaStream_t stream) {
  launch_kernel(process_logits_check_kernel, dim3(1), dim3(kCheckThreads), stream, v, errors);
}

void launch_process_logits(const ProcessLogitsView& v, cudaStream_t stream) {
  with_device_type(v.logits_type, [&](auto type) {
    using T = typename decltype(type)::type;
    launch_kernel(process_logits_kernel<T>, grid_of(process_logits_blocks(v)), dim3(kProcessThreads), stream, v);
  });
}

}  // namespace specdec::cuda
