// CPU backend of the sampling family (contract in ../sampling.h): one row per task of
// at::parallel_for, each position's distribution materialised in per-thread scratch.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "../sampling.h"
#include "distribution.h"

namespace specdec::cpu {
namespace {

template <typename scalar_t>
void chain_verify_rows(const ChainVerifyArgs& a) {
  const int64_t batch = a.target_logits.size(0);
  const int64_t k = a.target_logits.size(1) - 1;
  const int64_t vocab = a.target_logits.size(2);
  const scalar_t* logits = a.target_logits.data_ptr<scalar_t>();
  const int64_t* draft_ids = a.draft_token_ids.data_ptr<int64_t>();
  const float* draft_probs = a.draft_probs ? a.draft_probs->data_ptr<float>() : nullptr;
  const int32_t* num_draft = a.num_draft ? a.num_draft->data_ptr<int32_t>() : nullptr;
  const float* uniforms = a.uniforms ? a.uniforms->data_ptr<float>() : nullptr;
  const int64_t* seed = a.seed ? a.seed->data_ptr<int64_t>() : nullptr;
  const int64_t* offset = a.offset ? a.offset->data_ptr<int64_t>() : nullptr;
  int64_t* tokens = a.tokens.data_ptr<int64_t>();
  int32_t* num_accepted = a.num_accepted.data_ptr<int32_t>();

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    TargetDistribution dist(vocab);
    for (int64_t b = begin; b < end; ++b) {
      int64_t* row_tokens = tokens + b * (k + 1);
      std::fill(row_tokens, row_tokens + k + 1, static_cast<int64_t>(kEmptySlot));
      auto uniform = [&](int64_t column) {
        return uniforms ? uniforms[b * (k + 1) + column]
                        : philox_uniform(seed[b], offset ? offset[b] : 0, column);
      };
      const FilterParams filter = read_filter(a.temperature, a.top_k, a.top_p, b);
      const int64_t n = num_draft ? num_draft[b] : k;
      int32_t status = validate_filter(filter);
      if (status == 0 && (n < 0 || n > k)) status = kStatusNumDraftOutOfRange;
      for (int64_t c = 0; status == 0 && c <= k; ++c) {
        if (!is_valid_uniform(uniform(c))) status = kStatusInvalidUniform;
      }
      for (int64_t i = 0; status == 0 && i < n; ++i) {
        const int64_t x = draft_ids[b * k + i];
        if (x < 0 || x >= vocab) status = kStatusDraftTokenOutOfRange;
      }
      int64_t accepted = 0;
      int64_t emitted = -1;
      for (; status == 0 && accepted < n; ++accepted) {
        const int64_t x = draft_ids[b * k + accepted];
        status = dist.load(logits + (b * (k + 1) + accepted) * vocab, filter);
        if (status != 0) break;
        const float* q_row = draft_probs ? draft_probs + (b * k + accepted) * vocab : nullptr;
        const float q = q_row ? q_row[x] : 1.0f;
        if (!(q >= 0.0f && q <= 1.0f)) {
          status = kStatusInvalidDraftProbs;
          break;
        }
        if (accept_draft(uniform(accepted), dist.prob(x), q)) {
          row_tokens[accepted] = x;
          continue;
        }
        status = dist.subtract(q_row, x);  // the recovered token comes from the residual
        if (status == 0) emitted = dist.sample(uniform(k));
        break;
      }
      if (status == 0 && emitted < 0) {  // every draft accepted: the bonus token
        status = dist.load(logits + (b * (k + 1) + n) * vocab, filter);
        if (status == 0) emitted = dist.sample(uniform(k));
      }
      if (status != 0) {
        std::fill(row_tokens, row_tokens + k + 1, static_cast<int64_t>(kEmptySlot));
        num_accepted[b] = status;
        continue;
      }
      row_tokens[accepted] = emitted;
      num_accepted[b] = static_cast<int32_t>(accepted);
    }
  });
}

void chain_verify(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                  const std::optional<at::Tensor>& draft_probs,
                  const std::optional<at::Tensor>& num_draft,
                  const std::optional<at::Tensor>& temperature,
                  const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                  const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                  const std::optional<at::Tensor>& uniforms, at::Tensor& tokens,
                  at::Tensor& num_accepted) {
  const ChainVerifyArgs args{target_logits, draft_token_ids, draft_probs, num_draft, temperature,
                             top_k,         top_p,           seed,        offset,    uniforms,
                             tokens,        num_accepted};
  check_chain_verify(args);
  if (target_logits.size(0) == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, target_logits.scalar_type(),
                                  "chain_verify_cpu", [&] { chain_verify_rows<scalar_t>(args); });
}

template <typename scalar_t>
void residual_rows(const scalar_t* p, const scalar_t* q, float* out, int64_t rows, int64_t vocab) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* p_row = p + r * vocab;
      const scalar_t* q_row = q + r * vocab;
      float* out_row = out + r * vocab;
      float mass = 0.0f;
      for (int64_t j = 0; j < vocab; ++j) {
        const float d = static_cast<float>(p_row[j]) - static_cast<float>(q_row[j]);
        out_row[j] = d > 0.0f ? d : 0.0f;
        mass += out_row[j];
      }
      if (mass > 0.0f) {
        const float inv_mass = 1.0f / mass;
        for (int64_t j = 0; j < vocab; ++j) out_row[j] *= inv_mass;
      } else {
        for (int64_t j = 0; j < vocab; ++j) out_row[j] = static_cast<float>(p_row[j]);
      }
    }
  });
}

void residual_probs(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                    at::Tensor& out) {
  check_residual_probs(target_probs, draft_probs, out);
  const int64_t vocab = target_probs.size(-1);
  const int64_t rows = vocab == 0 ? 0 : target_probs.numel() / vocab;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, target_probs.scalar_type(),
                                  "residual_probs_cpu", [&] {
                                    residual_rows(target_probs.data_ptr<scalar_t>(),
                                                  draft_probs.data_ptr<scalar_t>(),
                                                  out.data_ptr<float>(), rows, vocab);
                                  });
}

void philox_uniforms(const at::Tensor& seed, const at::Tensor& offset, at::Tensor& out) {
  check_philox_uniforms(seed, offset, out);
  const int64_t* s = seed.data_ptr<int64_t>();
  const int64_t* o = offset.data_ptr<int64_t>();
  float* u = out.data_ptr<float>();
  const int64_t rows = out.size(0), columns = out.size(1);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t c = 0; c < columns; ++c) u[r * columns + c] = philox_uniform(s[r], o[r], c);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) {
  m.impl("chain_verify", &chain_verify);
  m.impl("residual_probs", &residual_probs);
  m.impl("philox_uniforms", &philox_uniforms);
}

}  // namespace specdec::cpu
