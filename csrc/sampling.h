// Contract of the sampling family: chain_verify, sample_filtered, residual_probs and philox_uniforms. A backend
// registers its implementations with register_sampling_ops(): the *_op adapters below take the
// schema's arguments, run the one check and hand the backend checked, non-empty tensors (the raw
// views of common/op_views.h come from the *_view() functions).
//
// chain_verify: lossless verification of a chain of k draft tokens per row (Leviathan et al. 2023).
//   The arguments shared with tree_verify (logits, ids, draft_probs, counts, sampling, outputs) are
//   described in verifier.h; for chains:
//   target_logits   [B, k+1, V] fp32/bf16/fp16  row i scores draft position i; row k the bonus position
//   draft_token_ids [B, k]      int64
//   draft_probs     [B, k, V]   fp32, optional: the distribution each draft token was sampled from;
//                               absent means deterministic drafts (q one-hot at the drafted token)
//   num_draft       [B] int32, optional (k): ragged draft lengths, 0 <= num_draft <= k
//   uniforms        [B, k+1] fp32, optional: column i < num_draft[b] accepts draft position i, column
//                   num_draft[b] samples the recovered or bonus token (a row's draws do not depend on
//                   the buffer's width k: a seeded row drafting 4 in a k = 8 buffer draws as with k = 4)
//   tokens          [B, k+1] int64 out: accepted tokens, then the recovered/bonus token, then -1
//   num_accepted    [B] int32 out: accepted draft tokens (the row emits num_accepted + 1 tokens),
//                   or a negative RowStatus when the row's input is invalid (tokens then all -1)
//   Per row, status checks before anything is emitted: validate_filter() (-5, -6, -7), num_draft in
//   [0, k] (-4), draws (-11 when a sampling row has neither seed nor uniforms, -8 for a uniform
//   outside [0, 1)), draft ids in [0, V) (-3); then the walk (-1 for a non-finite logits row, -2 for
//   an invalid draft probability at a position read, a q row whose sum strays from 1 by more than
//   kProbabilitySumTolerance where a rejection reads it whole, or q(x) = 0 at a draft x: it cannot have been
//   drawn).
//
// residual_probs: normalise(max(0, p - q)) over the last dimension; p where that mass is zero.
//   target_probs [..., V] fp32/bf16/fp16, draft_probs [..., V] same shape, out [..., V] fp32.
//
// sample_filtered: a drafter's sampled step. Row b's distribution is the one the verifiers use for
//   the target (filtered softmax(logits / T): temperature, top-k, top-p, one-hot at the argmax for a
//   greedy row; common/sampling_math.h); it is written to probs[b] and one token is drawn from it by
//   inverse CDF at draw 0 of the row (uniforms[b, 0], or philox(seed[b], offset[b], 0)).
//   logits      [B, V] fp32/bf16/fp16
//   temperature, top_k, top_p, seed, offset [B] optional, uniforms [B, 1] optional (verifier.h)
//   probs       [B, V] fp32 out, unit stride along V, any row stride >= V (a column of [B, k, V])
//   tokens      [B] int64 out: the drawn token, or a negative RowStatus (probs[b] is then all NaN, so a
//               verifier handed that q reports the row):
//               -5/-6/-7 the filter, -11 no draws for a sampling row, -8 a uniform outside [0, 1),
//               -1 a non-finite logits row.
//
// philox_uniforms: the uniforms the verifiers draw, out[b, c] = philox(seed[b], offset[b], c).
//   seed, offset [B] int64; out [B, C] fp32.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "checks.h"
#include "common/op_views.h"
#include "tensor_data.h"
#include "verifier.h"

namespace specdec {

using ChainVerifyArgs = VerifierArgs;

inline void check_chain_verify(const ChainVerifyArgs& a) {
  const VerifierNames names{"chain_verify", "k", "draft_token_ids", "num_draft"};
  check_verifier(names, a);
  check_outputs_apart(names, a, nullptr, nullptr);
}

// chain_verify's schema around a backend's implementation, which gets checked arguments, B > 0.
template <void (*Impl)(const ChainVerifyArgs&)>
void chain_verify_op(const at::Tensor& target_logits, const at::Tensor& draft_token_ids,
                     const c10::optional<at::Tensor>& draft_probs, const c10::optional<at::Tensor>& num_draft,
                     const c10::optional<at::Tensor>& temperature, const c10::optional<at::Tensor>& top_k,
                     const c10::optional<at::Tensor>& top_p, const c10::optional<at::Tensor>& seed,
                     const c10::optional<at::Tensor>& offset, const c10::optional<at::Tensor>& uniforms,
                     at::Tensor& tokens, at::Tensor& num_accepted) {
  const ChainVerifyArgs args{target_logits, draft_token_ids, draft_probs, num_draft,
                             {temperature, top_k, top_p, seed, offset, uniforms}, tokens, num_accepted};
  check_chain_verify(args);
  if (target_logits.size(0) > 0) Impl(args);
}

inline void check_residual_probs(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                 const at::Tensor& out) {
  constexpr const char* op = "residual_probs";
  SPECDEC_CHECK(target_probs.dim() >= 1, op, ": target_probs must have at least 1 dimension [..., V]");
  SPECDEC_CHECK(target_probs.size(-1) >= 1, op, ": target_probs must have V >= 1");
  check_dtype(op, "target_probs", target_probs, {at::kFloat, at::kBFloat16, at::kHalf});
  SPECDEC_CHECK(draft_probs.sizes() == target_probs.sizes(), op,
                ": draft_probs must have the shape of target_probs ", shape_str(target_probs.sizes()),
                ", got ", shape_str(draft_probs.sizes()));
  SPECDEC_CHECK(draft_probs.scalar_type() == target_probs.scalar_type(), op,
                ": draft_probs must have the dtype of target_probs (", target_probs.scalar_type(),
                "), got ", draft_probs.scalar_type());
  SPECDEC_CHECK(out.sizes() == target_probs.sizes(), op, ": out must have the shape of target_probs ",
                shape_str(target_probs.sizes()), ", got ", shape_str(out.sizes()));
  check_dtype(op, "out", out, {at::kFloat});
  check_same_device(op, "draft_probs", draft_probs, target_probs, "target_probs");
  check_same_device(op, "out", out, target_probs, "target_probs");
  check_contiguous(op, "target_probs", target_probs);
  check_contiguous(op, "draft_probs", draft_probs);
  check_contiguous(op, "out", out);
  // (a row's residual mass is summed before the row is written)
  check_written_apart(op, {{"out", &out}}, {{"target_probs", &target_probs}, {"draft_probs", &draft_probs}});
}

inline ResidualProbsView residual_probs_view(const at::Tensor& target_probs, const at::Tensor& draft_probs,
                                             const at::Tensor& out) {
  const int64_t vocab = target_probs.size(-1);
  return {target_probs.data_ptr(), draft_probs.data_ptr(), element_type(target_probs),
          out.data_ptr<float>(), target_probs.numel() / vocab, vocab};
}

inline void check_philox_uniforms(const at::Tensor& seed, const at::Tensor& offset,
                                  const at::Tensor& out) {
  constexpr const char* op = "philox_uniforms";
  check_rank(op, "out", out, 2, "[B, C]");
  check_dtype(op, "out", out, {at::kFloat});
  check_contiguous(op, "out", out);
  check_row_param(op, "seed", seed, out.size(0), at::kLong, out, "out");
  check_row_param(op, "offset", offset, out.size(0), at::kLong, out, "out");
}

inline PhiloxUniformsView philox_uniforms_view(const at::Tensor& seed, const at::Tensor& offset,
                                               const at::Tensor& out) {
  return {seed.data_ptr<int64_t>(), offset.data_ptr<int64_t>(), out.data_ptr<float>(), out.size(0),
          out.size(1)};
}

struct SampleFilteredArgs {
  const at::Tensor& logits;
  SamplingArgs sampling;
  const at::Tensor& probs;
  const at::Tensor& tokens;
};

inline void check_sample_filtered(const SampleFilteredArgs& a) {
  constexpr const char* op = "sample_filtered";
  check_rank(op, "logits", a.logits, 2, "[B, V]");
  check_dtype(op, "logits", a.logits, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "logits", a.logits);
  const int64_t batch = a.logits.size(0), vocab = a.logits.size(1);
  SPECDEC_CHECK(vocab >= 1, op, ": logits must have a vocabulary of at least 1 token");
  check_sampling_args(op, batch, 1, a.sampling, a.logits, "logits");
  check_rank(op, "probs", a.probs, 2, "[B, V]");
  check_size(op, "probs", a.probs, 0, batch, "B");
  check_size(op, "probs", a.probs, 1, vocab, "V (the logits' vocabulary)");
  check_dtype(op, "probs", a.probs, {at::kFloat});
  check_same_device(op, "probs", a.probs, a.logits, "logits");
  SPECDEC_CHECK(a.probs.stride(1) == 1 && (batch <= 1 || a.probs.stride(0) >= vocab), op,
                ": probs must have unit stride along V and rows that do not overlap, got strides ",
                shape_str(a.probs.strides()));
  check_output(op, "tokens", a.tokens, batch, -1, "", at::kLong, a.logits, "logits");
}

inline SampleFilteredView sample_filtered_view(const SampleFilteredArgs& a) {
  SampleFilteredView v;
  v.logits = a.logits.data_ptr();
  v.logits_type = element_type(a.logits);
  v.sampling = sampling_params(a.sampling, 1);
  v.probs = a.probs.data_ptr<float>();
  v.probs_row_stride = a.probs.size(0) > 1 ? a.probs.stride(0) : a.logits.size(1);
  v.tokens = a.tokens.data_ptr<int64_t>();
  v.batch = a.logits.size(0);
  v.vocab = a.logits.size(1);
  return v;
}

template <void (*Impl)(const SampleFilteredArgs&)>
void sample_filtered_op(const at::Tensor& logits, const c10::optional<at::Tensor>& temperature,
                        const c10::optional<at::Tensor>& top_k, const c10::optional<at::Tensor>& top_p,
                        const c10::optional<at::Tensor>& seed, const c10::optional<at::Tensor>& offset,
                        const c10::optional<at::Tensor>& uniforms, at::Tensor& probs, at::Tensor& tokens) {
  const SampleFilteredArgs args{logits, {temperature, top_k, top_p, seed, offset, uniforms}, probs, tokens};
  check_sample_filtered(args);
  if (logits.size(0) > 0) Impl(args);
}

template <void (*Impl)(const at::Tensor&, const at::Tensor&, at::Tensor&)>
void residual_probs_op(const at::Tensor& target_probs, const at::Tensor& draft_probs, at::Tensor& out) {
  check_residual_probs(target_probs, draft_probs, out);
  if (target_probs.numel() > 0) Impl(target_probs, draft_probs, out);
}

template <void (*Impl)(const at::Tensor&, const at::Tensor&, at::Tensor&)>
void philox_uniforms_op(const at::Tensor& seed, const at::Tensor& offset, at::Tensor& out) {
  check_philox_uniforms(seed, offset, out);
  if (out.numel() > 0) Impl(seed, offset, out);
}

// Registers a backend's implementations of the family's ops under their schemas.
template <void (*ChainVerify)(const ChainVerifyArgs&),
          void (*ResidualProbs)(const at::Tensor&, const at::Tensor&, at::Tensor&),
          void (*PhiloxUniforms)(const at::Tensor&, const at::Tensor&, at::Tensor&),
          void (*SampleFiltered)(const SampleFilteredArgs&)>
void register_sampling_ops(torch::Library& m) {
  m.impl("chain_verify", &chain_verify_op<ChainVerify>);
  m.impl("sample_filtered", &sample_filtered_op<SampleFiltered>);
  m.impl("residual_probs", &residual_probs_op<ResidualProbs>);
  m.impl("philox_uniforms", &philox_uniforms_op<PhiloxUniforms>);
}

}  // namespace specdec
