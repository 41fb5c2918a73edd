// One row of a verifier on the CPU, shared by chain_verify (sampling.cpp) and tree_verify
// (tree.cpp): its filter, draws and slots, the status checks every verifier makes before its walk
// (in the contract's order), one draft's accept-or-subtract step, and the row's outputs.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "../common/op_views.h"
#include "../common/sampling_math.h"
#include "distribution.h"

namespace specdec::cpu {

class VerifierRow {
 public:
  VerifierRow(const VerifierView& view, int64_t row)
      : v_(view),
        row_(row),
        filter_(view.sampling.filter(row)),
        count_(view.row_count(row)),
        tokens_(view.tokens + row * (view.drafts + 1)) {
    std::fill(tokens_, tokens_ + v_.drafts + 1, int64_t{kEmptySlot});
  }

  int64_t index() const { return row_; }
  const FilterParams& filter() const { return filter_; }
  int64_t count() const { return count_; }  // num_draft / num_nodes of this row, unchecked
  float draw(int64_t column) const { return v_.sampling.draw(row_, column); }
  int64_t token_id(int64_t slot) const { return v_.token_ids[row_ * v_.drafts + slot]; }
  template <typename scalar_t>
  const scalar_t* logits(int64_t position) const {
    return static_cast<const scalar_t*>(v_.logits) + (row_ * (v_.drafts + 1) + position) * v_.vocab;
  }

  // validate_filter(), then the caller's structure check (the draft count, or the tree), then the
  // draws (missing, or outside [0, 1)), then the token ids of the used slots.
  template <typename StructureStatus>
  int32_t start_status(StructureStatus structure_status) const {
    int32_t status = validate_filter(filter_);
    if (status == 0) status = structure_status();
    if (status == 0) status = v_.sampling.missing_draws_status(filter_);
    for (int64_t c = 0; status == 0 && v_.sampling.has_draws() && c <= v_.drafts; ++c) {
      if (!is_valid_uniform(draw(c))) status = kStatusInvalidUniform;
    }
    for (int64_t i = 0; status == 0 && i < count_; ++i) {
      const int64_t x = token_id(i);
      if (x < 0 || x >= v_.vocab) status = kStatusDraftTokenOutOfRange;
    }
    return status;
  }

  // Tries the draft of `slot` (decided by draw column `slot`) against p. Returns true when it is
  // accepted; otherwise p becomes the residual normalise(max(0, p - q)) and `status` says whether
  // the draft distribution was valid.
  bool accept_or_subtract(TargetDistribution& p, int64_t slot, int32_t& status) const {
    const int64_t x = token_id(slot);
    const float* q_row = v_.draft_probs ? v_.draft_probs + (row_ * v_.drafts + slot) * v_.vocab : nullptr;
    const float q = q_row ? q_row[x] : 1.0f;
    if (!(q > 0.0f && q <= 1.0f)) {  // (q(x) = 0: x cannot have been drawn from q; min(1, p / 0) took it)
      status = kStatusInvalidDraftProbs;
      return false;
    }
    if (accept_draft(draw(slot), p.prob(x), q)) return true;
    status = p.subtract(q_row, x);
    return false;
  }

  void set_token(int64_t index, int64_t token) { tokens_[index] = token; }

  // The row's outputs: tokens[accepted] = emitted and num_accepted = accepted, or for a status all
  // tokens -1 and num_accepted = status. Returns status.
  int32_t finish(int32_t status, int64_t accepted, int64_t emitted) {
    if (status != 0) {
      std::fill(tokens_, tokens_ + v_.drafts + 1, int64_t{kEmptySlot});
      v_.num_accepted[row_] = status;
      return status;
    }
    tokens_[accepted] = emitted;
    v_.num_accepted[row_] = static_cast<int32_t>(accepted);
    return status;
  }

 private:
  const VerifierView& v_;
  int64_t row_;
  FilterParams filter_;
  int64_t count_;
  int64_t* tokens_;
};

// Runs walk(row, p) for every row of the batch, rows in parallel; p is per-thread scratch that
// the walk loads (TargetDistribution::load) before it reads it.
template <typename RowWalk>
void for_each_verifier_row(const VerifierView& v, RowWalk&& walk) {
  at::parallel_for(0, v.batch, 1, [&](int64_t begin, int64_t end) {
    TargetDistribution p(v.vocab);
    for (int64_t b = begin; b < end; ++b) {
      VerifierRow row(v, b);
      walk(row, p);
    }
  });
}

}  // namespace specdec::cpu
