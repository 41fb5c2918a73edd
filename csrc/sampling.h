// Contract of the sampling family: chain_verify and residual_probs. Both backends call the
// check_*() functions here before touching data.
//
// chain_verify: lossless verification of a chain of k draft tokens per row (Leviathan et al. 2023).
//   target_logits   [B, k+1, V] fp32/bf16/fp16  row i scores draft position i; row k the bonus position
//   draft_token_ids [B, k]      int64
//   draft_probs     [B, k, V]   fp32, optional: the distribution each draft token was sampled from;
//                               absent means deterministic drafts (q one-hot at the drafted token)
//   num_draft       [B] int32, optional (k): ragged draft lengths, 0 <= num_draft <= k
//   temperature     [B] fp32, optional (1): 0 means greedy
//   top_k           [B] int32, optional (0 = off);  top_p [B] fp32, optional (1 = off)
//   seed, offset    [B] int64, optional: Philox key and counter; uniform i = philox(seed, offset, i)
//   uniforms        [B, k+1] fp32, optional: explicit draws instead of Philox (column i < k accepts
//                   draft position i, column k samples the recovered or bonus token)
//   tokens          [B, k+1] int64 out: accepted tokens, then the recovered/bonus token, then -1
//   num_accepted    [B] int32 out: accepted draft tokens (the row emits num_accepted + 1 tokens),
//                   or a negative RowStatus when the row's input is invalid (tokens then all -1)
//
// residual_probs: normalise(max(0, p - q)) over the last dimension; p where that mass is zero.
//   target_probs [..., V] fp32/bf16/fp16, draft_probs [..., V] same shape, out [..., V] fp32.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "checks.h"

namespace specdec {

struct ChainVerifyArgs {
  const at::Tensor& target_logits;
  const at::Tensor& draft_token_ids;
  const c10::optional<at::Tensor>& draft_probs;
  const c10::optional<at::Tensor>& num_draft;
  const c10::optional<at::Tensor>& temperature;
  const c10::optional<at::Tensor>& top_k;
  const c10::optional<at::Tensor>& top_p;
  const c10::optional<at::Tensor>& seed;
  const c10::optional<at::Tensor>& offset;
  const c10::optional<at::Tensor>& uniforms;
  const at::Tensor& tokens;
  const at::Tensor& num_accepted;
};

// The sampling parameters every verifier takes, checked the same way by chain and tree ops.
inline void check_sampling_params(const char* op, int64_t batch, const at::Tensor& reference,
                                  const char* reference_name,
                                  const c10::optional<at::Tensor>& temperature,
                                  const c10::optional<at::Tensor>& top_k,
                                  const c10::optional<at::Tensor>& top_p,
                                  const c10::optional<at::Tensor>& seed,
                                  const c10::optional<at::Tensor>& offset,
                                  const c10::optional<at::Tensor>& uniforms,
                                  int64_t num_uniforms) {
  check_row_param(op, "temperature", temperature, batch, at::kFloat, reference, reference_name);
  check_row_param(op, "top_k", top_k, batch, at::kInt, reference, reference_name);
  check_row_param(op, "top_p", top_p, batch, at::kFloat, reference, reference_name);
  check_row_param(op, "seed", seed, batch, at::kLong, reference, reference_name);
  check_row_param(op, "offset", offset, batch, at::kLong, reference, reference_name);
  if (uniforms.has_value()) {
    check_rank(op, "uniforms", *uniforms, 2, "[B, draws]");
    check_size(op, "uniforms", *uniforms, 0, batch, "B");
    check_size(op, "uniforms", *uniforms, 1, num_uniforms, "the number of draws per row");
    check_dtype(op, "uniforms", *uniforms, {at::kFloat});
    check_same_device(op, "uniforms", *uniforms, reference, reference_name);
    check_contiguous(op, "uniforms", *uniforms);
  } else {
    TORCH_CHECK(seed.has_value(), op,
                ": pass either uniforms or seed (with an optional offset) for the random draws");
  }
}

inline void check_chain_verify(const ChainVerifyArgs& a) {
  constexpr const char* op = "chain_verify";
  check_rank(op, "target_logits", a.target_logits, 3, "[B, k+1, V]");
  check_dtype(op, "target_logits", a.target_logits, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "target_logits", a.target_logits);
  const int64_t batch = a.target_logits.size(0);
  const int64_t k = a.target_logits.size(1) - 1;
  const int64_t vocab = a.target_logits.size(2);
  TORCH_CHECK(k >= 0, op, ": target_logits must have k+1 >= 1 positions, got shape ",
              shape_str(a.target_logits.sizes()));
  TORCH_CHECK(vocab >= 1, op, ": target_logits must have a vocabulary of at least 1 token");

  check_rank(op, "draft_token_ids", a.draft_token_ids, 2, "[B, k]");
  check_size(op, "draft_token_ids", a.draft_token_ids, 0, batch, "B");
  check_size(op, "draft_token_ids", a.draft_token_ids, 1, k, "k (target_logits has k+1 positions)");
  check_dtype(op, "draft_token_ids", a.draft_token_ids, {at::kLong});
  check_same_device(op, "draft_token_ids", a.draft_token_ids, a.target_logits, "target_logits");
  check_contiguous(op, "draft_token_ids", a.draft_token_ids);

  if (a.draft_probs.has_value()) {
    const at::Tensor& q = *a.draft_probs;
    check_rank(op, "draft_probs", q, 3, "[B, k, V]");
    check_size(op, "draft_probs", q, 0, batch, "B");
    check_size(op, "draft_probs", q, 1, k, "k");
    check_size(op, "draft_probs", q, 2, vocab, "V (the target's vocabulary)");
    check_dtype(op, "draft_probs", q, {at::kFloat});
    check_same_device(op, "draft_probs", q, a.target_logits, "target_logits");
    check_contiguous(op, "draft_probs", q);
  }
  check_row_param(op, "num_draft", a.num_draft, batch, at::kInt, a.target_logits, "target_logits");
  check_sampling_params(op, batch, a.target_logits, "target_logits", a.temperature, a.top_k,
                        a.top_p, a.seed, a.offset, a.uniforms, k + 1);

  check_rank(op, "tokens", a.tokens, 2, "[B, k+1]");
  check_size(op, "tokens", a.tokens, 0, batch, "B");
  check_size(op, "tokens", a.tokens, 1, k + 1, "k+1");
  check_dtype(op, "tokens", a.tokens, {at::kLong});
  check_same_device(op, "tokens", a.tokens, a.target_logits, "target_logits");
  check_contiguous(op, "tokens", a.tokens);
  check_rank(op, "num_accepted", a.num_accepted, 1, "[B]");
  check_size(op, "num_accepted", a.num_accepted, 0, batch, "B");
  check_dtype(op, "num_accepted", a.num_accepted, {at::kInt});
  check_same_device(op, "num_accepted", a.num_accepted, a.target_logits, "target_logits");
  check_contiguous(op, "num_accepted", a.num_accepted);
}

inline void check_residual_probs(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                 const at::Tensor& out) {
  constexpr const char* op = "residual_probs";
  TORCH_CHECK(target_probs.dim() >= 1, op, ": target_probs must have at least 1 dimension [..., V]");
  TORCH_CHECK(target_probs.size(-1) >= 1, op, ": target_probs must have V >= 1");
  check_dtype(op, "target_probs", target_probs, {at::kFloat, at::kBFloat16, at::kHalf});
  TORCH_CHECK(draft_probs.sizes() == target_probs.sizes(), op,
              ": draft_probs must have the shape of target_probs ", shape_str(target_probs.sizes()),
              ", got ", shape_str(draft_probs.sizes()));
  TORCH_CHECK(draft_probs.scalar_type() == target_probs.scalar_type(), op,
              ": draft_probs must have the dtype of target_probs (", target_probs.scalar_type(),
              "), got ", draft_probs.scalar_type());
  TORCH_CHECK(out.sizes() == target_probs.sizes(), op, ": out must have the shape of target_probs ",
              shape_str(target_probs.sizes()), ", got ", shape_str(out.sizes()));
  check_dtype(op, "out", out, {at::kFloat});
  check_same_device(op, "draft_probs", draft_probs, target_probs, "target_probs");
  check_same_device(op, "out", out, target_probs, "target_probs");
  check_contiguous(op, "target_probs", target_probs);
  check_contiguous(op, "draft_probs", draft_probs);
  check_contiguous(op, "out", out);
}

}  // namespace specdec

namespace specdec {

// philox_uniforms: the uniforms the verifiers draw, out[b, c] = philox(seed[b], offset[b], c).
//   seed, offset [B] int64; out [B, C] fp32.
inline void check_philox_uniforms(const at::Tensor& seed, const at::Tensor& offset,
                                  const at::Tensor& out) {
  constexpr const char* op = "philox_uniforms";
  check_rank(op, "out", out, 2, "[B, C]");
  check_dtype(op, "out", out, {at::kFloat});
  check_contiguous(op, "out", out);
  check_row_param(op, "seed", seed, out.size(0), at::kLong, out, "out");
  check_row_param(op, "offset", offset, out.size(0), at::kLong, out, "out");
}

}  // namespace specdec
