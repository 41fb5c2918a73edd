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

#include <string>

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

// Target logits [B, n+1, V], the drafted ids [B, n] and the optional draft probabilities [B, n, V]
// that every verifier takes; `n` names the draft dimension ("k" for chains, "N" for trees).
struct VerifierShape {
  int64_t batch, drafts, vocab;
};

inline VerifierShape check_verifier_inputs(const char* op, const char* n, const at::Tensor& target_logits,
                                           const char* ids_name, const at::Tensor& ids,
                                           const c10::optional<at::Tensor>& draft_probs) {
  const std::string logits_layout = std::string("[B, ") + n + "+1, V]";
  check_rank(op, "target_logits", target_logits, 3, logits_layout.c_str());
  check_dtype(op, "target_logits", target_logits, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "target_logits", target_logits);
  const VerifierShape shape{target_logits.size(0), target_logits.size(1) - 1, target_logits.size(2)};
  TORCH_CHECK(shape.drafts >= 0, op, ": target_logits must have ", n, "+1 >= 1 positions, got shape ",
              shape_str(target_logits.sizes()));
  TORCH_CHECK(shape.vocab >= 1, op, ": target_logits must have a vocabulary of at least 1 token");

  const std::string ids_layout = std::string("[B, ") + n + "]";
  const std::string ids_what = std::string(n) + " (target_logits has " + n + "+1 positions)";
  check_rank(op, ids_name, ids, 2, ids_layout.c_str());
  check_size(op, ids_name, ids, 0, shape.batch, "B");
  check_size(op, ids_name, ids, 1, shape.drafts, ids_what.c_str());
  check_dtype(op, ids_name, ids, {at::kLong});
  check_same_device(op, ids_name, ids, target_logits, "target_logits");
  check_contiguous(op, ids_name, ids);

  if (draft_probs.has_value()) {
    const at::Tensor& q = *draft_probs;
    const std::string q_layout = std::string("[B, ") + n + ", V]";
    check_rank(op, "draft_probs", q, 3, q_layout.c_str());
    check_size(op, "draft_probs", q, 0, shape.batch, "B");
    check_size(op, "draft_probs", q, 1, shape.drafts, n);
    check_size(op, "draft_probs", q, 2, shape.vocab, "V (the target's vocabulary)");
    check_dtype(op, "draft_probs", q, {at::kFloat});
    check_same_device(op, "draft_probs", q, target_logits, "target_logits");
    check_contiguous(op, "draft_probs", q);
  }
  return shape;
}

// An output the op writes: [B] (width < 0) or [B, width], one dtype, beside target_logits.
inline void check_output(const char* op, const char* name, const at::Tensor& out, int64_t batch,
                         int64_t width, const char* width_name, at::ScalarType dtype,
                         const at::Tensor& target_logits) {
  const std::string layout = width < 0 ? std::string("[B]") : std::string("[B, ") + width_name + "]";
  check_rank(op, name, out, width < 0 ? 1 : 2, layout.c_str());
  check_size(op, name, out, 0, batch, "B");
  if (width >= 0) check_size(op, name, out, 1, width, width_name);
  check_dtype(op, name, out, {dtype});
  check_same_device(op, name, out, target_logits, "target_logits");
  check_contiguous(op, name, out);
}

inline void check_chain_verify(const ChainVerifyArgs& a) {
  constexpr const char* op = "chain_verify";
  const VerifierShape shape = check_verifier_inputs(op, "k", a.target_logits, "draft_token_ids",
                                                    a.draft_token_ids, a.draft_probs);
  check_row_param(op, "num_draft", a.num_draft, shape.batch, at::kInt, a.target_logits, "target_logits");
  check_sampling_params(op, shape.batch, a.target_logits, "target_logits", a.temperature, a.top_k,
                        a.top_p, a.seed, a.offset, a.uniforms, shape.drafts + 1);
  check_output(op, "tokens", a.tokens, shape.batch, shape.drafts + 1, "k+1", at::kLong, a.target_logits);
  check_output(op, "num_accepted", a.num_accepted, shape.batch, -1, "", at::kInt, a.target_logits);
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
