// The AMX tiles of the weights that the amxbf16 path streams from memory (simd/amx.h: pack_weight),
// packed on a weight's first use and kept while it lives and is unchanged: the lean runner's models
// hand the ops the HF model's own tensors at every call, and a pass of one row reads the packed tiles
// 1.2-1.4x faster than the row-major weight (BENCHMARKS.md). It costs a second copy of those weights.
#pragma once
#include <ATen/core/Tensor.h>

namespace specdec::cpu {

// The packed copy of `weight` (bf16 [N, K], K a multiple of 32, N >= 16; row stride weight.stride(0)),
// shared by every tensor over the same storage, offset and shape (a parameter and its detach()ed
// copies): packed on first use, again when the data pointer or the version counter has changed, dropped
// once the storage is freed. As the Python side's cached_cast: a write the version counter does not see
// (through `.data`, or inside inference mode) leaves the copy stale. Thread safe; the returned tensor
// keeps the tiles alive for the caller.
// Shape: [N / 16 * 16 * K] bf16 (simd/amx.h's [N / 16][K / 32][16][32])
at::Tensor amx_packed_weight(const at::Tensor& weight);

}  // namespace specdec::cpu
