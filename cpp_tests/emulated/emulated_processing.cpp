// process_logits's kernels under the emulator (declared in test_emulated_processing.cpp: raw views
// in, "" or the emulator's first error out, as emulated_kernels.h's functions).
#include <cuda_emu.h>

#include <cstdint>
#include <string>

#include "cuda/logits_processing.cu"  // the launches of the CUDA build, compiled here
#include "logits_processing.h"

namespace specdec::emulated {

std::string process_logits(const ProcessLogitsView& view) {
  return cuda_emu::errors_of([&] { cuda::launch_process_logits(view, nullptr); });
}

std::string process_logits_check(const ProcessLogitsView& view, int32_t* errors) {
  *errors = 0x7EADBEEF;  // garbage until the kernel writes it, as device memory would hold
  return cuda_emu::errors_of([&] { cuda::launch_process_logits_check(view, errors, nullptr); });
}

bool process_logits_fits(const ProcessLogitsView& view) { return cuda::process_logits_fits(view); }

}  // namespace specdec::emulated
