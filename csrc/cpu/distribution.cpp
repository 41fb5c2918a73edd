#include "distribution.h"

namespace specdec::cpu {

int32_t TargetDistribution::subtract(const float* q_row, int64_t token) {
  if (one_hot_token_ >= 0) {
    // max(0, onehot(a) - q) is zero or a multiple of onehot(a): p stays one-hot; only check q.
    return (q_row == nullptr || residual_pass(weights_.data(), 0.0f, q_row, vocab_, false).q_valid)
               ? 0
               : kStatusInvalidDraftProbs;
  }
  materialize();
  if (q_row == nullptr) {  // remove `token`: r_j = w_j / mass for j != token
    const float removed = weights_[token];
    weights_[token] = 0.0f;
    const float mass = row_sum(weights_.data(), vocab_);
    if (mass > 0.0f) {
      mass_ = mass;
    } else {
      weights_[token] = removed;
    }
    return 0;
  }
  const float inv_mass = 1.0f / mass_;
  const ResidualSum residual = residual_pass(weights_.data(), inv_mass, q_row, vocab_, false);
  if (!residual.q_valid) return kStatusInvalidDraftProbs;
  if (!(residual.mass > 0.0f)) return 0;
  mass_ = residual_pass(weights_.data(), inv_mass, q_row, vocab_, true).mass;
  return 0;
}

int64_t TargetDistribution::sample(float u) {
  if (one_hot_token_ >= 0) return one_hot_token_;
  materialize();
  return inverse_cdf(weights_.data(), vocab_, u * mass_);
}

void TargetDistribution::write_probs(float* out) {
  if (one_hot_token_ >= 0) {
    for (int64_t j = 0; j < vocab_; ++j) out[j] = j == one_hot_token_ ? 1.0f : 0.0f;
    return;
  }
  materialize();
  for (int64_t j = 0; j < vocab_; ++j) out[j] = weights_[j] / mass_;
}

void TargetDistribution::measure_at(uint32_t pivot, bool count_only, float& measure,
                                    uint32_t& min_key_at_or_above, uint32_t& max_key_below) const {
  // In double: a float running sum over a 128k-token row drifts by ~1e-4 of the mass, enough to move
  // top-p's boundary by a token where the exact sum lies within that of top_p * M (the CUDA block
  // reduction lands within ~1e-6; measured on an H200 against this loop in float: 5 of 18 top-p rows
  // of a 128256-token vocabulary cut at a different token).
  double total = 0.0;
  uint32_t min_above = 0xFFFFFFFFu;
  uint32_t max_below = 0u;
  for (int64_t j = 0; j < vocab_; ++j) {
    const uint32_t key = float_key(logits_[j]);
    if (key >= pivot) {
      total += count_only ? 1.0 : static_cast<double>(weights_[j]);
      min_above = key < min_above ? key : min_above;
    } else {
      max_below = key > max_below ? key : max_below;
    }
  }
  measure = static_cast<float>(total);
  min_key_at_or_above = min_above;
  max_key_below = max_below;
}

void TargetDistribution::apply_filter(const FilterParams& filter) {
  uint32_t min_key = 0xFFFFFFFFu;
  for (int64_t j = 0; j < vocab_; ++j) {
    const uint32_t key = float_key(logits_[j]);
    min_key = key < min_key ? key : min_key;
  }
  const uint32_t past_max_key = float_key(max_logit_) + 1u;
  uint32_t threshold = min_key;

  auto run_search = [&](ThresholdSearch search, bool count_only) {
    while (!search.done()) {
      float measure;
      uint32_t min_above, max_below;
      measure_at(search.pivot(), count_only, measure, min_above, max_below);
      search.update(measure, min_above, max_below);
    }
    return search.lo;
  };
  if (filter.top_k > 0 && filter.top_k < vocab_) {
    threshold = run_search({min_key, past_max_key, static_cast<float>(filter.top_k)}, true);
  }
  if (filter.top_p < 1.0f) {
    float kept_mass;
    uint32_t unused_min, unused_max;
    measure_at(threshold, false, kept_mass, unused_min, unused_max);
    threshold = run_search({threshold, past_max_key, filter.top_p * kept_mass}, false);
  }
  for (int64_t j = 0; j < vocab_; ++j) {
    if (float_key(logits_[j]) < threshold) weights_[j] = 0.0f;
  }
  mass_ = row_sum(weights_.data(), vocab_);
}

}  // namespace specdec::cpu
