// How close a verifier row's decisions come to their boundaries, in float64: the CPU op and a CUDA
// kernel compute p in fp32 with sums in different orders, so they may disagree exactly where a
// draw lies within rounding of a boundary (u * q against p(x), u * mass against a CDF step, a top-p
// cut, a residual mass against 0), and only there.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace specdec_test {

struct VerifierInputs {
  at::Tensor logits;                      // [B, n+1, V], any floating dtype
  at::Tensor ids;                         // [B, n] int64
  std::optional<at::Tensor> parents;      // [B, n] int32 for trees; chains when absent
  std::optional<at::Tensor> draft_probs;  // [B, n, V] fp32
  std::optional<at::Tensor> counts;       // [B] int32
  std::optional<at::Tensor> temperature, top_k, top_p, seed, offset, uniforms;
};

// The smallest relative distance of row b's decisions from their boundaries along the float64
// walk (+inf for greedy rows, whose decisions are exact). The row must be valid (no status).
double decision_margin(const VerifierInputs& in, int64_t row);

}  // namespace specdec_test
