#include "reference_margin.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "common/philox.h"
#include "common/sampling_math.h"

namespace specdec_test {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// One row of the inputs in float64, with its filter and draws.
class Row {
 public:
  Row(const VerifierInputs& in, int64_t b) : in_(in), b_(b) {
    logits_ = in.logits[b].to(at::kDouble).contiguous();
    drafts_ = in.ids.size(1);
    vocab_ = in.logits.size(2);
    if (in.draft_probs) q_ = (*in.draft_probs)[b].to(at::kDouble).contiguous();
    temperature_ = in.temperature ? (*in.temperature)[b].item<float>() : 1.0f;
    top_k_ = in.top_k ? (*in.top_k)[b].item<int32_t>() : 0;
    top_p_ = in.top_p ? (*in.top_p)[b].item<float>() : 1.0f;
  }

  bool greedy() const { return specdec::is_greedy(temperature_); }
  int64_t count() const { return in_.counts ? (*in_.counts)[b_].item<int32_t>() : drafts_; }
  int64_t id(int64_t slot) const { return in_.ids[b_][slot].item<int64_t>(); }
  int32_t parent(int64_t slot) const { return (*in_.parents)[b_][slot].item<int32_t>(); }
  double draw(int64_t column) const {
    if (in_.uniforms) return (*in_.uniforms)[b_][column].item<float>();
    const int64_t offset = in_.offset ? (*in_.offset)[b_].item<int64_t>() : 0;
    return specdec::philox_uniform((*in_.seed)[b_].item<int64_t>(), offset, column);
  }
  const double* q_row(int64_t slot) const { return q_.defined() ? q_.data_ptr<double>() + slot * vocab_ : nullptr; }

  // Unnormalised filtered weights at a position (sampling_math.h); the top-p cut's margin joins `margin`.
  std::vector<double> weights(int64_t position, double& margin) const {
    const double* l = logits_.data_ptr<double>() + position * vocab_;
    std::vector<double> w(vocab_);
    const double max = *std::max_element(l, l + vocab_);
    for (int64_t j = 0; j < vocab_; ++j) {
      const double scaled = (l[j] - max) / static_cast<double>(temperature_);
      w[j] = std::isnan(scaled) ? 0.0 : std::exp(scaled);  // NaN: a -inf logit at T = inf
    }
    std::vector<int64_t> order(vocab_);
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return l[a] > l[b]; });
    double threshold = -kInfinity;
    if (top_k_ > 0 && top_k_ < vocab_) threshold = l[order[top_k_ - 1]];
    if (top_p_ < 1.0f) {
      double kept = 0.0;
      for (int64_t j = 0; j < vocab_; ++j) kept += l[j] >= threshold ? w[j] : 0.0;
      const double target = static_cast<double>(top_p_) * kept;
      double before = 0.0, cumulative = 0.0;
      for (int64_t i = 0; i < vocab_ && l[order[i]] >= threshold;) {
        const double group = l[order[i]];
        for (; i < vocab_ && l[order[i]] == group; ++i) cumulative += w[order[i]];
        if (cumulative >= target) {
          margin = std::min({margin, (cumulative - target) / kept, (target - before) / kept});
          threshold = group;
          break;
        }
        before = cumulative;
      }
    }
    for (int64_t j = 0; j < vocab_; ++j) {
      if (l[j] < threshold) w[j] = 0.0;
    }
    return w;
  }

 private:
  const VerifierInputs& in_;
  int64_t b_;
  at::Tensor logits_, q_;
  int64_t drafts_, vocab_;
  float temperature_;
  int32_t top_k_;
  float top_p_;
};

double total(const std::vector<double>& w) { return std::accumulate(w.begin(), w.end(), 0.0); }

bool accept(double u, double p, double q, double& margin) {
  const double uq = u * q;
  const double scale = std::max(p, uq);
  if (scale > 0.0) margin = std::min(margin, std::abs(uq - p) / scale);
  return uq < p;
}

// w <- max(0, w / mass - q) where that has mass, q one-hot at x when q_row is null.
void subtract(std::vector<double>& w, const double* q_row, int64_t x, double& margin) {
  const double mass = total(w);
  std::vector<double> r(w.size());
  for (size_t j = 0; j < w.size(); ++j) {
    const double q = q_row ? q_row[j] : (static_cast<int64_t>(j) == x ? 1.0 : 0.0);
    r[j] = std::max(0.0, w[j] / mass - q);
  }
  const double residual = total(r);
  margin = std::min(margin, residual);  // a residual of (almost) zero mass keeps p
  if (residual > 0.0) w.swap(r);
}

void sample(const std::vector<double>& w, double u, double& margin) {
  const double mass = total(w);
  const double target = u * mass;
  double before = 0.0;
  for (double weight : w) {
    if (weight <= 0.0) continue;
    const double after = before + weight;
    if (after > target) {
      margin = std::min({margin, (target - before) / mass, (after - target) / mass});
      return;
    }
    before = after;
  }
  margin = 0.0;  // rounding at the very end of the row
}

}  // namespace

double decision_margin(const VerifierInputs& in, int64_t b) {
  const Row row(in, b);
  if (row.greedy()) return kInfinity;
  const int64_t n = row.count();
  double margin = kInfinity;
  int64_t current = -1;  // chains walk position by position: current = i - 1
  for (;;) {
    std::vector<double> w = row.weights(current + 1, margin);
    int64_t next = -1;
    const int64_t first = current + 1;
    const int64_t last = in.parents ? n - 1 : std::min(current + 1, n - 1);  // a chain has one candidate
    for (int64_t c = first; c <= last; ++c) {
      if (in.parents && row.parent(c) != current) continue;
      const int64_t x = row.id(c);
      const double* q = row.q_row(c);
      if (accept(row.draw(c), w[x] / total(w), q ? q[x] : 1.0, margin)) {
        next = c;
        break;
      }
      subtract(w, q, x, margin);
    }
    if (next < 0) {
      sample(w, row.draw(n), margin);
      return margin;
    }
    current = next;
  }
}

}  // namespace specdec_test
