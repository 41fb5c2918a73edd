// What chain_verify (sampling.h) and tree_verify (tree.h) share: the sampling arguments, the
// verifier arguments, their one check (run by every backend before touching data) and their raw
// view (common/op_views.h). n below is the number of draft slots: k for chains, N for trees.
//
//   target_logits  [B, n+1, V] fp32/bf16/fp16
//   token ids      [B, n] int64        draft_token_ids / tree_token_ids
//   draft_probs    [B, n, V] fp32, optional
//   counts         [B] int32, optional (n): num_draft / num_nodes, the slots a row uses
//   temperature    [B] fp32, optional (1): below kGreedyTemperature (1e-5) greedy, +inf uniform
//                  over the finite logits (common/sampling_math.h)
//   top_k          [B] int32, optional (0 = off);  top_p [B] fp32, optional (1 = off)
//   seed, offset   [B] int64, optional: Philox key and counter; draw c = philox(seed, offset, c)
//   uniforms       [B, n+1] fp32, optional: explicit draws instead of Philox (wins over seed)
//                  With neither seed nor uniforms, greedy rows run (they read no draw) and every
//                  other row reports kStatusMissingRandomness.
//   tokens         [B, n+1] int64 out;  num_accepted [B] int32 out
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <iterator>
#include <string>
#include <utility>

#include "checks.h"
#include "common/op_views.h"
#include "tensor_data.h"

namespace specdec {

struct SamplingArgs {
  const c10::optional<at::Tensor>& temperature;
  const c10::optional<at::Tensor>& top_k;
  const c10::optional<at::Tensor>& top_p;
  const c10::optional<at::Tensor>& seed;
  const c10::optional<at::Tensor>& offset;
  const c10::optional<at::Tensor>& uniforms;
};

struct VerifierArgs {
  const at::Tensor& target_logits;
  const at::Tensor& token_ids;
  const c10::optional<at::Tensor>& draft_probs;
  const c10::optional<at::Tensor>& counts;
  SamplingArgs sampling;
  const at::Tensor& tokens;
  const at::Tensor& num_accepted;
};

// The names a verifier's messages use for its arguments.
struct VerifierNames {
  const char* op;      // "chain_verify"
  const char* n;       // "k"
  const char* ids;     // "draft_token_ids"
  const char* counts;  // "num_draft"
};

struct VerifierShape {
  int64_t batch, drafts, vocab;
};

// An output the op writes: [B] (width < 0) or [B, width], one dtype, beside target_logits.
inline void check_output(const char* op, const char* name, const at::Tensor& out, int64_t batch,
                         int64_t width, const char* width_name, at::ScalarType dtype,
                         const at::Tensor& target_logits, const char* logits_name = "target_logits") {
  const std::string layout = width < 0 ? std::string("[B]") : std::string("[B, ") + width_name + "]";
  check_rank(op, name, out, width < 0 ? 1 : 2, layout.c_str());
  check_size(op, name, out, 0, batch, "B");
  if (width >= 0) check_size(op, name, out, 1, width, width_name);
  check_dtype(op, name, out, {dtype});
  check_same_device(op, name, out, target_logits, logits_name);
  check_contiguous(op, name, out);
}

inline void check_sampling_args(const char* op, int64_t batch, int64_t draws, const SamplingArgs& s,
                                const at::Tensor& target_logits, const char* logits_name = "target_logits") {
  const auto row_param = [&](const char* name, const c10::optional<at::Tensor>& t, at::ScalarType dtype) {
    check_row_param(op, name, t, batch, dtype, target_logits, logits_name);
  };
  row_param("temperature", s.temperature, at::kFloat);
  row_param("top_k", s.top_k, at::kInt);
  row_param("top_p", s.top_p, at::kFloat);
  row_param("seed", s.seed, at::kLong);
  row_param("offset", s.offset, at::kLong);
  if (s.uniforms.has_value()) {
    check_matrix(op, "uniforms", *s.uniforms, "[B, draws]", batch, "B", draws, "the number of draws per row",
                 at::kFloat, target_logits, logits_name);
  }
}

// No output of a verifier (tokens, num_accepted, and tree_verify's path and parents: `extra_output`,
// `extra_input`, or null) shares memory with another output or with an input (the walk writes its outputs
// before it has read every input). Called once per op, after the shape checks; no allocation.
inline void check_outputs_apart(const VerifierNames& names, const VerifierArgs& a, const at::Tensor* extra_output,
                                const at::Tensor* extra_input) {
  const auto optional = [](const c10::optional<at::Tensor>& t) { return t ? &*t : nullptr; };
  check_written_apart(names.op, {{"tokens", &a.tokens}, {"num_accepted", &a.num_accepted}, {"path", extra_output}},
                      {{"target_logits", &a.target_logits},
                       {names.ids, &a.token_ids},
                       {"parents", extra_input},
                       {"draft_probs", optional(a.draft_probs)},
                       {names.counts, optional(a.counts)},
                       {"temperature", optional(a.sampling.temperature)},
                       {"top_k", optional(a.sampling.top_k)},
                       {"top_p", optional(a.sampling.top_p)},
                       {"seed", optional(a.sampling.seed)},
                       {"offset", optional(a.sampling.offset)},
                       {"uniforms", optional(a.sampling.uniforms)}});
}

// The one check of a verifier's shared arguments; returns (B, n, V).
inline VerifierShape check_verifier(const VerifierNames& names, const VerifierArgs& a) {
  const char* op = names.op;
  const std::string n = names.n;
  check_rank(op, "target_logits", a.target_logits, 3, ("[B, " + n + "+1, V]").c_str());
  check_dtype(op, "target_logits", a.target_logits, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(op, "target_logits", a.target_logits);
  const VerifierShape shape{a.target_logits.size(0), a.target_logits.size(1) - 1, a.target_logits.size(2)};
  SPECDEC_CHECK(shape.drafts >= 0, op, ": target_logits must have ", n, "+1 >= 1 positions, got shape ",
                shape_str(a.target_logits.sizes()));
  SPECDEC_CHECK(shape.vocab >= 1, op, ": target_logits must have a vocabulary of at least 1 token");

  check_matrix(op, names.ids, a.token_ids, ("[B, " + n + "]").c_str(), shape.batch, "B", shape.drafts,
               (n + " (target_logits has " + n + "+1 positions)").c_str(), at::kLong, a.target_logits,
               "target_logits");

  if (a.draft_probs.has_value()) {
    const at::Tensor& q = *a.draft_probs;
    check_rank(op, "draft_probs", q, 3, ("[B, " + n + ", V]").c_str());
    check_size(op, "draft_probs", q, 0, shape.batch, "B");
    check_size(op, "draft_probs", q, 1, shape.drafts, names.n);
    check_size(op, "draft_probs", q, 2, shape.vocab, "V (the target's vocabulary)");
    check_dtype(op, "draft_probs", q, {at::kFloat});
    check_same_device(op, "draft_probs", q, a.target_logits, "target_logits");
    check_contiguous(op, "draft_probs", q);
  }
  check_row_param(op, names.counts, a.counts, shape.batch, at::kInt, a.target_logits, "target_logits");
  check_sampling_args(op, shape.batch, shape.drafts + 1, a.sampling, a.target_logits);
  check_output(op, "tokens", a.tokens, shape.batch, shape.drafts + 1, (n + "+1").c_str(), at::kLong,
               a.target_logits);
  check_output(op, "num_accepted", a.num_accepted, shape.batch, -1, "", at::kInt, a.target_logits);
  return shape;
}

inline SamplingParams sampling_params(const SamplingArgs& s, int64_t draws) {
  return {optional_data<float>(s.temperature), optional_data<int32_t>(s.top_k),
          optional_data<float>(s.top_p),       optional_data<int64_t>(s.seed),
          optional_data<int64_t>(s.offset),    optional_data<float>(s.uniforms),
          draws};
}

// The raw view of checked verifier arguments.
inline VerifierView verifier_view(const VerifierArgs& a) {
  VerifierView v;
  v.logits = a.target_logits.data_ptr();
  v.logits_type = element_type(a.target_logits);
  v.token_ids = a.token_ids.data_ptr<int64_t>();
  v.draft_probs = optional_data<float>(a.draft_probs);
  v.counts = optional_data<int32_t>(a.counts);
  v.batch = a.target_logits.size(0);
  v.drafts = a.target_logits.size(1) - 1;
  v.vocab = a.target_logits.size(2);
  v.sampling = sampling_params(a.sampling, v.drafts + 1);
  v.tokens = a.tokens.data_ptr<int64_t>();
  v.num_accepted = a.num_accepted.data_ptr<int32_t>();
  return v;
}

}  // namespace specdec
