// The host side of the sampling family's kernels (sampling.cuh): the entry points that launches.h
// declares. No torch: nvcc compiles this file with the kernels alone, and the torch wrapper
// (sampling_ops.cpp) is the host compiler's; the emulated-kernel tests (cpp_tests/emulated) compile
// this same file under the CPU emulator.
#include <cstddef>
#include <cstdint>

#include "../common/op_views.h"
#include "launch.cuh"
#include "launches.h"
#include "sampling.cuh"

namespace specdec::cuda {

static int64_t chain_stats_blocks(const ChainVerifyView& v) {
  return v.batch * (v.drafts + 1) * stats_chunks(v.vocab);
}

size_t chain_verify_workspace_bytes(const ChainVerifyView& v) {
  return static_cast<size_t>(chain_stats_blocks(v)) * sizeof(RowStats);
}

bool chain_verify_fits(const ChainVerifyView& v) {
  return v.vocab < INT32_MAX && chain_stats_blocks(v) <= INT32_MAX;
}

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
