// One position's filtered target distribution on the CPU, shared by chain_verify and tree_verify.
// p = w / mass with w the unnormalised weights. Until a caller needs the whole row (subtract or
// sample), w stays implicit: w_j = exp((l_j - max) / T) is recomputed from the logits, so an
// accepted position costs one max pass and one exp-sum pass and writes nothing.
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/sampling_math.h"
#include "vector_math.h"

namespace specdec::cpu {

class TargetDistribution {
 public:
  explicit TargetDistribution(int64_t vocab) : vocab_(vocab), converted_(vocab), weights_(vocab) {}

  // p <- filtered softmax(logits / T) (one-hot at the argmax when the row is greedy).
  // Returns 0 or kStatusNonFiniteLogits.
  template <typename scalar_t>
  int32_t load(const scalar_t* logits, const FilterParams& filter) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      logits_ = logits;
    } else {
      for (int64_t j = 0; j < vocab_; ++j) converted_[j] = static_cast<float>(logits[j]);
      logits_ = converted_.data();
    }
    const RowMax row = row_max(logits_, vocab_);
    if (row.has_nan || row.max == __builtin_inff() || row.max == -__builtin_inff()) {
      return kStatusNonFiniteLogits;
    }
    max_logit_ = row.max;
    if (is_greedy(filter.temperature)) {
      int64_t argmax = 0;
      while (logits_[argmax] != row.max) ++argmax;  // the lowest index on ties
      one_hot_token_ = argmax;
      mass_ = 1.0f;
      return 0;
    }
    one_hot_token_ = -1;
    inv_temperature_ = inverse_temperature(filter.temperature);
    const bool filtered = filter.top_k > 0 || filter.top_p < 1.0f;
    mass_ = exp_sum(logits_, vocab_, max_logit_, inv_temperature_, filtered ? weights_.data() : nullptr);
    materialized_ = filtered;
    if (filtered) apply_filter(filter);
    return 0;
  }

  float prob(int64_t token) const {
    if (one_hot_token_ >= 0) return token == one_hot_token_ ? 1.0f : 0.0f;
    const float w = materialized_ ? weights_[token]
                                  : exp_nonpositive(weight_exponent(logits_[token], max_logit_, inv_temperature_));
    return w / mass_;
  }

  // p <- normalise(max(0, p - q)), the residual after rejecting a draft sampled from q; q is a
  // probability row, or one-hot at `token` when q_row is null (which removes `token` from p).
  // Where the residual mass is zero (p == q) p is kept. Returns 0 or kStatusInvalidDraftProbs.
  int32_t subtract(const float* q_row, int64_t token);

  // Inverse CDF: the smallest index whose running sum of w exceeds u * mass.
  int64_t sample(float u);

  // out[j] = p_j for every token (w_j / mass; one-hot for a greedy row).
  void write_probs(float* out);

 private:
  void materialize() {
    if (!materialized_) exp_sum(logits_, vocab_, max_logit_, inv_temperature_, weights_.data());
    materialized_ = true;
  }
  // Zeroes the weights of logits below lambda = max(lambda_k, lambda_p) (sampling_math.h).
  void apply_filter(const FilterParams& filter);
  // Sum of weights (or count, with count_only) over keys >= pivot, and the keys around the pivot.
  void measure_at(uint32_t pivot, bool count_only, float& measure, uint32_t& min_key_at_or_above,
                  uint32_t& max_key_below) const;

  int64_t vocab_;
  std::vector<float> converted_;  // fp32 copy of 16-bit logits
  std::vector<float> weights_;    // w, valid when materialized_
  const float* logits_ = nullptr;
  float max_logit_ = 0.0f;
  float inv_temperature_ = 1.0f;
  float mass_ = 0.0f;
  int64_t one_hot_token_ = -1;  // >= 0 for greedy rows: p is one-hot there
  bool materialized_ = false;
};

}  // namespace specdec::cpu
