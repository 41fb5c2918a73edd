// CPU backend of the sampling family (contract in ../sampling.h): one row per task of
// at::parallel_for, each position's distribution materialised in per-thread scratch.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "../sampling.h"
#include "distribution.h"
#include "verifier_row.h"

namespace specdec::cpu {
namespace {

template <typename scalar_t>
void chain_verify_rows(const ChainVerifyView& v) {
  const int64_t k = v.drafts;
  for_each_verifier_row(v, [&](VerifierRow& row, TargetDistribution& p) {
    const int64_t n = row.count();
    int32_t status = row.start_status([&] { return n < 0 || n > k ? kStatusNumDraftOutOfRange : 0; });
    int64_t accepted = 0;
    int64_t emitted = -1;
    for (; status == 0 && accepted < n; ++accepted) {
      status = p.load(row.logits<scalar_t>(accepted), row.filter());
      if (status != 0) break;
      if (row.accept_or_subtract(p, accepted, status)) {
        row.set_token(accepted, row.token_id(accepted));
        continue;
      }
      if (status == 0) emitted = p.sample(row.draw(n));  // the recovered token, from the residual
      break;
    }
    if (status == 0 && emitted < 0) {  // every draft accepted: the bonus token
      status = p.load(row.logits<scalar_t>(n), row.filter());
      if (status == 0) emitted = p.sample(row.draw(n));
    }
    row.finish(status, accepted, emitted);
  });
}

void chain_verify(const ChainVerifyArgs& args) {
  const ChainVerifyView view = verifier_view(args);
  AT_DISPATCH_V2(args.target_logits.scalar_type(), "chain_verify_cpu",
                 AT_WRAP([&] { chain_verify_rows<scalar_t>(view); }), at::kFloat, at::kBFloat16, at::kHalf);
}

template <typename scalar_t>
void sample_filtered_rows(const SampleFilteredView& v) {
  at::parallel_for(0, v.batch, 1, [&](int64_t begin, int64_t end) {
    TargetDistribution p(v.vocab);
    for (int64_t b = begin; b < end; ++b) {
      const FilterParams filter = v.sampling.filter(b);
      int32_t status = validate_filter(filter);
      if (status == 0) status = v.sampling.missing_draws_status(filter);
      const float u = v.sampling.draw(b, 0);
      if (status == 0 && v.sampling.has_draws() && !is_valid_uniform(u)) status = kStatusInvalidUniform;
      if (status == 0) status = p.load(static_cast<const scalar_t*>(v.logits) + b * v.vocab, filter);
      float* probs = v.probs + b * v.probs_row_stride;
      if (status != 0) {
        std::fill(probs, probs + v.vocab, std::numeric_limits<float>::quiet_NaN());
        v.tokens[b] = status;
        continue;
      }
      p.write_probs(probs);
      v.tokens[b] = p.sample(u);
    }
  });
}

void sample_filtered(const SampleFilteredArgs& args) {
  const SampleFilteredView view = sample_filtered_view(args);
  AT_DISPATCH_V2(args.logits.scalar_type(), "sample_filtered_cpu",
                 AT_WRAP([&] { sample_filtered_rows<scalar_t>(view); }), at::kFloat, at::kBFloat16, at::kHalf);
}

template <typename scalar_t>
void residual_rows(const ResidualProbsView& v) {
  const scalar_t* p = static_cast<const scalar_t*>(v.target_probs);
  const scalar_t* q = static_cast<const scalar_t*>(v.draft_probs);
  const int64_t vocab = v.vocab;
  at::parallel_for(0, v.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* p_row = p + r * vocab;
      const scalar_t* q_row = q + r * vocab;
      float* out_row = v.out + r * vocab;
      float mass = 0.0f;
      for (int64_t j = 0; j < vocab; ++j) {
        const float d = static_cast<float>(p_row[j]) - static_cast<float>(q_row[j]);
        out_row[j] = d > 0.0f ? d : 0.0f;
        mass += out_row[j];
      }
      const float inv_mass = 1.0f / mass;
      if (mass > 0.0f && std::isfinite(inv_mass)) {
        for (int64_t j = 0; j < vocab; ++j) out_row[j] *= inv_mass;
      } else if (mass > 0.0f) {  // a subnormal mass: its reciprocal overflows
        for (int64_t j = 0; j < vocab; ++j) out_row[j] /= mass;
      } else {
        for (int64_t j = 0; j < vocab; ++j) out_row[j] = static_cast<float>(p_row[j]);
      }
    }
  });
}

void residual_probs(const at::Tensor& target_probs, const at::Tensor& draft_probs, at::Tensor& out) {
  const ResidualProbsView view = residual_probs_view(target_probs, draft_probs, out);
  AT_DISPATCH_V2(target_probs.scalar_type(), "residual_probs_cpu", AT_WRAP([&] { residual_rows<scalar_t>(view); }),
                 at::kFloat, at::kBFloat16, at::kHalf);
}

void philox_uniforms(const at::Tensor& seed, const at::Tensor& offset, at::Tensor& out) {
  const PhiloxUniformsView v = philox_uniforms_view(seed, offset, out);
  at::parallel_for(0, v.rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < v.columns; ++c) v.out[r * v.columns + c] = philox_uniform(v.seed[r], v.offset[r], c);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) {
  register_sampling_ops<chain_verify, residual_probs, philox_uniforms, sample_filtered>(m);
}

}  // namespace specdec::cpu
