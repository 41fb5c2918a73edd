// The sampling family's kernels under the emulator (emulated_kernels.h).
#include <cuda_emu.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "cuda/sampling.cu"  // the launches of the CUDA build, compiled here
#include "emulated_kernels.h"

namespace specdec::emulated {

std::string chain_verify(const ChainVerifyView& view) {
  const size_t bytes = cuda::chain_verify_workspace_bytes(view);
  const std::unique_ptr<unsigned char[]> workspace(new unsigned char[bytes + 1]);
  std::memset(workspace.get(), 0xFF, bytes + 1);  // NaN statistics until the stats kernel writes them
  return cuda_emu::errors_of([&] { cuda::launch_chain_verify(view, workspace.get(), nullptr); });
}

std::string sample_filtered(const SampleFilteredView& view) {
  return cuda_emu::errors_of([&] { cuda::launch_sample_filtered(view, nullptr); });
}

std::string residual_probs(const ResidualProbsView& view) {
  return cuda_emu::errors_of([&] { cuda::launch_residual_probs(view, nullptr); });
}

std::string philox_uniforms(const PhiloxUniformsView& view) {
  return cuda_emu::errors_of([&] { cuda::launch_philox_uniforms(view, nullptr); });
}

}  // namespace specdec::emulated
