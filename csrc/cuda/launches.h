// The CUDA kernels' host entry points, from the ops' raw views (common/op_views.h): grid limits,
// workspace sizes and launches, defined in the kernels' translation units (cuda/<family>.cu, the
// only files nvcc compiles) and called by the torch wrappers (cuda/<family>_ops.cpp, compiled by the
// host compiler, which parses torch's headers once where nvcc parses them several times: the tree
// family took 150 s as one .cu, 54 s + 18 s split). No torch and no kernels here. The emulated-kernel
// tests (cpp_tests/emulated) compile the same <family>.cu files under the CPU emulator
// (SPECDEC_CUDA_EMULATOR) and call these same functions.
#pragma once
#include <cstddef>
#include <cstdint>

#if defined(SPECDEC_CUDA_EMULATOR)
#include <cuda_emu.h>
#else
#include <cuda_runtime_api.h>
#endif

#include "../common/op_views.h"
#include "../logits_processing.h"

namespace specdec::cuda {

// ---- sampling.cu
// Bytes of chain_verify's workspace: the per-chunk statistics of every position.
size_t chain_verify_workspace_bytes(const ChainVerifyView& v);
// Whether the kernels' 32-bit indices (grid sizes, token indices) hold the view's sizes.
bool chain_verify_fits(const ChainVerifyView& v);
// `workspace`: chain_verify_workspace_bytes(v) bytes on the launch's device, ordered on `stream`.
void launch_chain_verify(const ChainVerifyView& v, void* workspace, cudaStream_t stream);
void launch_sample_filtered(const SampleFilteredView& v, cudaStream_t stream);
void launch_residual_probs(const ResidualProbsView& v, cudaStream_t stream);
// Blocks of philox_uniforms's grid (the wrapper checks that they fit 32 bits).
int64_t philox_blocks(const PhiloxUniformsView& v);
void launch_philox_uniforms(const PhiloxUniformsView& v, cudaStream_t stream);

// ---- tree.cu
void launch_build_tree_mask(const TreeMaskView& v, cudaStream_t stream);
constexpr int64_t kTreeWorkspaceAlignBytes = 32;
// Floats of tree_verify's fp32 workspace (one or two rows of p per batch row, tree.cu).
int64_t tree_verify_workspace_floats(const TreeVerifyView& v);
bool tree_verify_fits(const TreeVerifyView& v);
// `workspace`: tree_verify_workspace_floats(v) floats, kTreeWorkspaceAlignBytes aligned, on `stream`.
void launch_tree_verify(const TreeVerifyView& v, float* workspace, cudaStream_t stream);

// ---- logits_processing.cu
constexpr int kMaxProcessDrafts = 512;  // n the kernel supports (its prefix staged in shared memory)
// Whether the kernel holds the view: a column's prefix fits the shared-memory table, and the grid
// (one block per row and column) and the token indices fit 32 bits.
bool process_logits_fits(const ProcessLogitsView& v);
// Or-s row_value_errors over every row into *errors (one int32 on the launch's device).
void launch_process_logits_check(const ProcessLogitsView& v, int32_t* errors, cudaStream_t stream);
void launch_process_logits(const ProcessLogitsView& v, cudaStream_t stream);

// ---- kv_cache.cu
void launch_kv_write(const KvWriteView& v, cudaStream_t stream);
void launch_kv_compact(const KvCompactView& v, cudaStream_t stream);

// ---- token_buffer.cu
void launch_commit_tokens(const CommitTokensView& v, cudaStream_t stream);

}  // namespace specdec::cuda
