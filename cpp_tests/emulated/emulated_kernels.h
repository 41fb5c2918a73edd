// The CUDA kernels of csrc/cuda run on the CPU by the emulator of cpp_tests/cuda_emu, on host
// memory, through the same launch code as the CUDA wrappers (csrc/cuda/<family>.cu). Declared
// without torch or CUDA: the emulator's macros (threadIdx, __shared__, ...) stay inside the
// emulated translation units (emulated_*.cpp). Each function runs the op's launches to completion
// and returns "" when they ran cleanly, else the emulator's error (a divergent barrier, a
// deadlock, ...). Workspaces are allocated here and filled with garbage first, as a GPU's are.
#pragma once
#include <string>

#include "common/op_views.h"

namespace specdec::emulated {

std::string chain_verify(const ChainVerifyView& view);
std::string sample_filtered(const SampleFilteredView& view);
std::string residual_probs(const ResidualProbsView& view);
std::string philox_uniforms(const PhiloxUniformsView& view);
std::string build_tree_mask(const TreeMaskView& view);
std::string tree_verify(const TreeVerifyView& view);
std::string kv_write(const KvWriteView& view);
std::string kv_compact(const KvCompactView& view);
std::string commit_tokens(const CommitTokensView& view);

}  // namespace specdec::emulated
