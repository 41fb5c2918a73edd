// One position's filtered target distribution on the CPU, shared by chain_verify and tree_verify.
// It lives in per-thread scratch: `weights` holds unnormalised probabilities w, p = w / mass.
#pragma once
#include <cstdint>
#include <vector>

#include "../common/sampling_math.h"
#include "vector_math.h"

namespace specdec::cpu {

class TargetDistribution {
 public:
  explicit TargetDistribution(int64_t vocab) : vocab_(vocab), logits_(vocab), weights_(vocab) {}

  // p <- filtered softmax(logits / T) (one-hot at the argmax when T == 0).
  // Returns 0 or kStatusNonFiniteLogits.
  template <typename scalar_t>
  int32_t load(const scalar_t* logits, const FilterParams& filter) {
    float max_logit = -__builtin_inff();
    int64_t argmax = 0;
    bool finite = true;
    for (int64_t j = 0; j < vocab_; ++j) {
      const float l = static_cast<float>(logits[j]);
      logits_[j] = l;
      finite = finite && !(l != l) && l != __builtin_inff();
      if (l > max_logit) {
        max_logit = l;
        argmax = j;
      }
    }
    if (!finite || max_logit == -__builtin_inff()) return kStatusNonFiniteLogits;
    if (filter.temperature == 0.0f) {
      load_one_hot(argmax);
      return 0;
    }
    const float inv_temperature = 1.0f / filter.temperature;
    float mass = 0.0f;
    for (int64_t j = 0; j < vocab_; ++j) {
      const float w = exp_nonpositive((logits_[j] - max_logit) * inv_temperature);
      weights_[j] = w;
      mass += w;
    }
    mass_ = mass;
    if (filter.top_k > 0 || filter.top_p < 1.0f) apply_filter(filter, max_logit);
    return 0;
  }

  float prob(int64_t token) const { return weights_[token] / mass_; }

  // p <- normalise(max(0, p - q)), the residual after rejecting a draft sampled from q; q is a
  // probability row, or one-hot at `token` when q_row is null (which removes `token` from p).
  // Where the residual mass is zero (p == q) p is kept. Returns 0 or kStatusInvalidDraftProbs.
  int32_t subtract(const float* q_row, int64_t token) {
    const float inv_mass = 1.0f / mass_;
    float residual_mass = 0.0f;
    bool valid = true;
    for (int64_t j = 0; j < vocab_; ++j) {
      const float q = q_row ? q_row[j] : (j == token ? 1.0f : 0.0f);
      valid = valid && q >= 0.0f && q <= 1.0f;  // false for NaN
      const float r = weights_[j] * inv_mass - q;
      residual_mass += r > 0.0f ? r : 0.0f;
    }
    if (!valid) return kStatusInvalidDraftProbs;
    if (!(residual_mass > 0.0f)) return 0;
    for (int64_t j = 0; j < vocab_; ++j) {
      const float q = q_row ? q_row[j] : (j == token ? 1.0f : 0.0f);
      const float r = weights_[j] * inv_mass - q;
      weights_[j] = r > 0.0f ? r : 0.0f;
    }
    mass_ = residual_mass;
    return 0;
  }

  // Inverse CDF: the smallest index whose running sum of w exceeds u * mass.
  int64_t sample(float u) const {
    const float target = u * mass_;
    float running = 0.0f;
    int64_t last_positive = 0;
    for (int64_t j = 0; j < vocab_; ++j) {
      const float w = weights_[j];
      if (w > 0.0f) {
        running += w;
        last_positive = j;
        if (running > target) return j;
      }
    }
    return last_positive;  // rounding left the running sum at or below the target
  }

 private:
  void load_one_hot(int64_t argmax) {
    for (int64_t j = 0; j < vocab_; ++j) weights_[j] = 0.0f;
    weights_[argmax] = 1.0f;
    mass_ = 1.0f;
  }

  // Zeroes the weights of logits below lambda = max(lambda_k, lambda_p) (sampling_math.h).
  void apply_filter(const FilterParams& filter, float max_logit);
  // Sum of weights (or count, with count_only) over keys >= pivot, and the keys around the pivot.
  void measure_at(uint32_t pivot, bool count_only, float& measure, uint32_t& min_key_at_or_above,
                  uint32_t& max_key_below) const;

  int64_t vocab_;
  std::vector<float> logits_;
  std::vector<float> weights_;
  float mass_ = 0.0f;
};

}  // namespace specdec::cpu
