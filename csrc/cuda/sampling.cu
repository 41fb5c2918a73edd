// The host side of the sampling family's kernels (kernels in sampling.cuh): grids, limits, workspace sizes and
// launches, the entry points of launches.h. No torch: nvcc compiles this file and the kernels
// alone, the torch wrapper (sampling_ops.cpp) is the host compiler's; the emulated-kernel tests
// (cpp_tests/emulated) compile this same file under the CPU emulator.
#include <cstddef>
#include <cstdint>

#include "../common/op_views.h"
#include "launch.cuh"
#include "launches.h"
#include "sampling.cuh"

namespace specdec::cuda {

inline int64_t chain_stats_blocks(const ChainVerifyView& v) {
  return v.batch * (v.drafts + 1) * stats_chunks(v.vocab);
}

// Bytes of chain_verify's workspace: the per-chunk statistics of every position.
size_t chain_verify_workspace_bytes(const ChainVerifyView& v) {
  return static_cast<size_t>(chain_stats_blocks(v)) * sizeof(RowStats);
}

// Whether the kernels' 32-bit indices (grid sizes, token indices) hold the view's sizes.
bool chain_verify_fits(const ChainVerifyView& v) {
  return v.vocab < INT32_MAX && chain_stats_blocks(v) <= INT32_MAX;
}

// `workspace`: chain_verify_workspace_bytes(v) bytes on the launch's device, ordered on `stream`.
void launch_chain_verify(const ChainVerifyView& v, void* workspace, cudaStream_t stream) {
  ChainVerifyParams p;
  static_cast<ChainVerifyView&>(p) = v;
  p.stats = static_cast<RowStats*>(workspace);
  p.num_chunks = stats_chunks(v.vocab);
  with_device_type(v.logits_type, [&](auto type) {
    using T = typename decltype(type)::type;
    launch_kernel(chain_stats_kernel<T>, grid_of(chain_stats_blocks(v)), dim3(kStatsThreads), stream, p);
    launch_kernel(chain_decide_kernel<T>, grid_of(v.batch), dim3(kDecideThreads), stream, p);
  });
}

void launch_sample_filtered(const SampleFilteredView& v, cudaStream_t stream) {
  with_device_type(v.logits_type, [&](auto type) {
    using T = typename decltype(type)::type;
    launch_kernel(sample_filtered_kernel<T>, grid_of(v.batch), dim3(kDraftSampleThreads), stream, v);
  });
}

void launch_residual_probs(const ResidualProbsView& v, cudaStream_t stream) {
  with_device_type(v.probs_type, [&](auto type) {
    using T = typename decltype(type)::type;
    launch_kernel(residual_probs_kernel<T>, grid_of(v.rows), dim3(kResidualThreads), stream,
                  static_cast<const T*>(v.target_probs), static_cast<const T*>(v.draft_probs), v.out, v.vocab);
  });
}

int64_t philox_blocks(const PhiloxUniformsView& v) {
  return (v.rows * v.columns + kPhiloxThreads - 1) / kPhiloxThreads;
}

void launch_philox_uniforms(const PhiloxUniformsView& v, cudaStream_t stream) {
  launch_kernel(philox_uniforms_kernel, grid_of(philox_blocks(v)), dim3(kPhiloxThreads), stream, v.seed, v.offset,
                v.out, v.rows, v.columns);
}

}  // namespace specdec::cuda
