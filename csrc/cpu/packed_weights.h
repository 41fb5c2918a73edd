// The packed copies of the weights that the CPU kernels read (gemm_types.h): every path's panels, and on
// amxbf16 the AMX tiles of the weights it streams from memory (simd/amx.h: pack_weight). Packed on a
// weight's first use and kept while it lives and is unchanged: the lean runner's models hand the ops
// the HF model's own tensors at every call. It costs a second copy of the weights.
#pragma once
#include <ATen/core/Tensor.h>

#include "gemm_types.h"

namespace specdec::cpu {

// The packed copy of `weight` ([N, K] of fp32, bf16 or fp16, row stride weight.stride(0)) in `layout`,
// shared by every tensor over the same storage, offset and shape (a parameter and its detach()ed
// copies): packed on first use, again when the data pointer or the version counter has changed, dropped
// once the storage is freed. A write the version counter does not see (through `.data`, or inside
// inference mode) is caught by a fingerprint of 64 sampled elements, compared at a weight's first use after
// each recheck_packed_weights() (a lean runner's construction: once per generation), not at every call;
// a write that misses every sampled element is not (forget_packed_weights()).
// Thread safe; the returned tensor keeps the copy alive for the caller.
// Shape: uint8 [packed_panel_bytes(weight, layout)] (gemm_types.h's panels)
at::Tensor panel_packed_weight(const at::Tensor& weight, const PanelLayout& layout);

// Starts a new recheck epoch: each packed copy's fingerprint is compared again at its weight's next use.
void recheck_packed_weights();

// The bytes the packed copies hold (those of weights that are gone included, until a sweep).
int64_t packed_weight_bytes();

// Drops the packed copies of weights whose storage is gone (a collected model's): a copy is otherwise dropped
// only when another weight is packed.
void sweep_packed_weights();

// Drops every packed copy: each weight is packed again at its next use (after a write that neither the
// version counter nor the fingerprint sees: one row or a few elements written through `.data`).
void forget_packed_weights();

// The same for the amxbf16 route's tiles of a bf16 weight with K a multiple of 32 and N >= 16.
// Shape: [N / 16 * 16 * K] bf16 (simd/amx.h's [N / 16][K / 32][16][32])
at::Tensor amx_packed_weight(const at::Tensor& weight);

}  // namespace specdec::cpu
