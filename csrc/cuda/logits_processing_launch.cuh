// Host side of process_logits's kernels, from the op's raw view (../logits_processing.h): grid
// sizes, limits and launches. No torch includes: the torch wrapper (logits_processing.cu) and the
// emulated-kernel tests (cpp_tests/emulated) run exactly this code.
#pragma once
#include <cstdint>

#include "../logits_processing.h"
#include "launch.cuh"
#include "logits_processing.cuh"

namespace specdec::cuda {

inline int64_t process_logits_blocks(const ProcessLogitsView& v) { return v.batch * v.positions(); }

// Whether the kernel holds the view: a column's prefix fits the shared-memory table, and the grid
// (one block per row and column) and the token indices fit 32 bits.
inline bool process_logits_fits(const ProcessLogitsView& v) {
  return v.drafts <= kMaxProcessDrafts && process_logits_blocks(v) <= INT32_MAX && v.vocab < INT32_MAX;
}

// Or-s row_value_errors over every row into *errors (one int32 on the launch's device).
inline void launch_process_logits_check(const ProcessLogitsView& v, int32_t* errors, cudaStream_t stream) {
  launch_kernel(process_logits_check_kernel, dim3(1), dim3(kCheckThreads), stream, v, errors);
}

inline void launch_process_logits(const ProcessLogitsView& v, cudaStream_t stream) {
  with_device_type(v.logits_type, [&](auto type) {
    using T = typename decltype(type)::type;
    launch_kernel(process_logits_kernel<T>, grid_of(process_logits_blocks(v)), dim3(kProcessThreads), stream, v);
  });
}

}  // namespace specdec::cuda
