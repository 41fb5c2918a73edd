// CUDA backend of process_logits (contract in ../logits_processing.h, kernels in
// logits_processing.cuh, their launches in logits_processing.cu): the shared checks, a
// device guard, the current stream. The value checks run as a one-block kernel whose word of error
// bits is read on the host (one synchronisation), except during a CUDA graph capture, where
// nothing can be read: there the values go unchecked and the kernel stays in bounds whatever
// they are (../logits_processing.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "../checks.h"
#include "../logits_processing.h"
#include "launches.h"

namespace specdec::cuda {
namespace {

void process_logits(const ProcessLogitsArgs& args, const ProcessLogitsView& view) {
  SPECDEC_CHECK(process_logits_fits(view), "process_logits: logits of shape ", shape_str(args.logits.sizes()),
                " is too large for the CUDA kernel (it takes at most n = ", kMaxProcessDrafts, " drafts: P = n + 1 positions)");
  const c10::cuda::CUDAGuard guard(args.logits.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None) {
    const at::Tensor errors = at::empty({1}, args.logits.options().dtype(at::kInt));
    launch_process_logits_check(view, errors.data_ptr<int32_t>(), stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    raise_process_logits_value_errors(static_cast<uint32_t>(errors.item<int32_t>()), view);
  }
  launch_process_logits(view, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CUDA, m) { register_process_logits<process_logits>(m); }

}  // namespace specdec::cuda
