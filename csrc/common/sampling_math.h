// Scalar pieces of the sampling kernels shared by the CPU and CUDA backends (no torch here).
//
// Temperature. T < kGreedyTemperature (1e-5, vLLM's threshold; 0 included) is greedy: p is one-hot
// at the argmax (the lowest index on ties), which makes the acceptance rule below accept exactly the
// drafts equal to the argmax and emit the argmax; greedy rows read no draw. Below that threshold
// exp((l - max) / T) underflows to 0 for every logit more than 87 T below the max (sampling would
// differ from greedy only among near-ties), and from about 3e-39 down 1 / T overflows to inf.
// T = +inf is uniform over the finite logits: every weight is exp(0) = 1 except a -inf logit's,
// whose scaled logit (-inf - max) * 0 is NaN, and a NaN exponent gives weight 0 in both backends.
// Huge finite T (1e30) is the same in the limit: weights exp(-tiny) = 1. Negative or NaN T is
// kStatusInvalidTemperature.
//
// Filtering. At a position with temperature T >= kGreedyTemperature the target distribution is
//   e(j) = exp((l(j) - max_l) / T),  kept(j) = l(j) >= lambda,  p(j) = kept(j) e(j) / M,  M = sum kept e,
// where lambda = max(lambda_k, lambda_p):
//   lambda_k: the k-th largest logit (top-k; every logit tied with it is kept; off when k == 0 or k >= V),
//   lambda_p: the largest threshold whose kept mass (among the top-k) is >= top_p * M_k (top-p; the
//             smallest prefix of the sorted distribution reaching top_p, ties at the boundary kept).
// Both thresholds are found by ThresholdSearch below: a bisection over order-preserving integer keys
// of the logits, a few passes over the row and never a sort of the vocabulary. At T = +inf every
// finite logit weighs 1, so top-p keeps the smallest set of largest logits reaching top_p of them.
//
// Sampling. A token is drawn from weights w by inverse CDF: the smallest index j whose running sum
// of w exceeds u * sum(w); if rounding leaves no such index, the last index with positive weight.
#pragma once
#include <cstdint>
#include <cstring>

#include "philox.h"

namespace specdec {

// Per-row status written into num_accepted (>= 0 means success). The Python wrapper turns a
// negative value into an error that names the argument, which keeps the ops free of host syncs.
enum RowStatus : int32_t {
  kStatusNonFiniteLogits = -1,     // a NaN or +inf logit, or every logit -inf, at a position read
  kStatusInvalidDraftProbs = -2,   // a NaN, negative or > 1 draft probability at a position read, or 0 at its draft
  kStatusDraftTokenOutOfRange = -3,
  kStatusNumDraftOutOfRange = -4,
  kStatusInvalidTemperature = -5,  // negative or NaN
  kStatusInvalidTopK = -6,         // negative
  kStatusInvalidTopP = -7,         // outside (0, 1] or NaN
  kStatusInvalidUniform = -8,      // outside [0, 1) or NaN
  kStatusInvalidTree = -9,         // a parent index that is not -1 and not below the node's own
  kStatusNumNodesOutOfRange = -10,
  kStatusMissingRandomness = -11,  // T >= kGreedyTemperature but neither seed nor uniforms given
};

// Temperatures below this are greedy (see the top of this file); specdec_ext.ops.GREEDY_TEMPERATURE
// mirrors it for the Python side.
constexpr float kGreedyTemperature = 1e-5f;
// How far a draft distribution row (draft_probs, fp32) may sum from 1 when a verifier reads it whole (a
// rejection): a row scaled by 0.5 or 2 changes what is accepted and is not q; fp32 sums of a valid row stray
// by ~1e-6 (specdec_ext.ops.PROBABILITY_SUM_TOLERANCE[torch.float32] for residual_probs' inputs)
constexpr float kProbabilitySumTolerance = 1e-3f;

constexpr int32_t kEmptySlot = -1;  // token slots after the emitted ones

SPECDEC_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
#endif
}

// Order-preserving map from (non-NaN) floats to uint32: a < b  <=>  float_key(a) < float_key(b).
SPECDEC_HOST_DEVICE uint32_t float_key(float x) {
  const uint32_t bits = float_bits(x);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Largest key K with measure(K) >= target, where measure(K) = sum_j w(j) [key(j) >= K] is
// nonincreasing in K. Each pass over the row at pivot() gathers (measure at the pivot, the smallest
// key >= pivot, the largest key < pivot) and calls update(); `lo` is always a key present in the row
// and the interval [lo, hi) at least halves per pass, so at most 32 passes are needed.
struct ThresholdSearch {
  uint32_t lo;  // measure(lo) >= target
  uint32_t hi;  // measure(hi) < target, or one past the largest key
  float target;

  SPECDEC_HOST_DEVICE bool done() const { return hi - lo <= 1u; }
  SPECDEC_HOST_DEVICE uint32_t pivot() const { return lo + (hi - lo) / 2u; }
  SPECDEC_HOST_DEVICE void update(float measure_at_pivot, uint32_t min_key_at_or_above,
                                  uint32_t max_key_below) {
    if (measure_at_pivot >= target) {
      lo = min_key_at_or_above;  // the same kept set as the pivot, and a key present in the row
    } else {
      hi = max_key_below + 1u;   // no key lies in (max_key_below, pivot)
    }
  }
};

struct FilterParams {
  float temperature;  // < kGreedyTemperature: greedy
  int32_t top_k;      // 0: off
  float top_p;        // 1: off
};

SPECDEC_HOST_DEVICE int32_t validate_filter(const FilterParams& f) {
  if (!(f.temperature >= 0.0f)) return kStatusInvalidTemperature;  // also catches NaN
  if (f.top_k < 0) return kStatusInvalidTopK;
  if (!(f.top_p > 0.0f && f.top_p <= 1.0f)) return kStatusInvalidTopP;
  return 0;
}

// Whether a row with this temperature is greedy; NaN counts as greedy here, so callers that have
// not validated the filter yet take the path that reads no draws (validate_filter rejects it).
SPECDEC_HOST_DEVICE bool is_greedy(float temperature) { return !(temperature >= kGreedyTemperature); }

// 1 / T for sampling rows (0 at T = +inf), 0 for greedy ones (unused there).
SPECDEC_HOST_DEVICE float inverse_temperature(float temperature) {
  return is_greedy(temperature) ? 0.0f : 1.0f / temperature;
}

// The exponent of a logit's weight exp((logit - max_logit) / T): (logit - max_logit) * inv_temperature, where a
// finite logit whose distance from the max overflows to -inf (logits more than 3.4e38 apart) is taken at the
// largest finite distance instead: at T = +inf its weight is then exp(0) = 1 like every finite logit's, where
// -inf * 0 made it NaN and its weight 0; a -inf logit's stays -inf * 0 = NaN, weight 0 (exp_nonpositive,
// exp_weight). Below T = +inf the weight is as before: 0 at any T up to ~4e36. Branch-free (vector loops).
SPECDEC_HOST_DEVICE float weight_exponent(float logit, float max_logit, float inv_temperature) {
  const float distance = logit - max_logit;
  const float kLargest = 3.40282347e38f;  // FLT_MAX
  return (distance < -kLargest && logit >= -kLargest ? -kLargest : distance) * inv_temperature;
}

// Whether top-k or top-p removes anything at a sampling row (greedy rows are never filtered).
SPECDEC_HOST_DEVICE bool is_filtered(const FilterParams& f, int64_t vocab) {
  return !is_greedy(f.temperature) && ((f.top_k > 0 && f.top_k < vocab) || f.top_p < 1.0f);
}

SPECDEC_HOST_DEVICE bool is_valid_uniform(float u) { return u >= 0.0f && u < 1.0f; }

// Acceptance of a draft token with target probability p and draft probability q:
// u < min(1, p / q), written without the division so that q == 0 accepts whenever p > 0.
SPECDEC_HOST_DEVICE bool accept_draft(float u, float p, float q) { return u * q < p; }

}  // namespace specdec
