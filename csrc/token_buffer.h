// Contract of the token buffer family: commit_tokens, the step's commit of its emitted tokens (and a
// plain chain segment's) into the decode loop's token buffer in one call, where it was a dozen torch
// calls (a mask, a scatter into a scratch column, a gather of the last token), each ~5 us of host
// dispatch on the CPU between two passes. A backend registers its implementation with
// register_token_buffer_ops(), whose adapter runs the checks here first and skips empty calls.
//
// commit_tokens(tokens, num_accepted, active, token_buffer!, seq_lens!, num_kept!, next_input!)
//   tokens        [B, w] int64, unit stride along w (any row stride: a view of a wider buffer is fine)
//   num_accepted  [B] int32: the verdict's accepted drafts, or a negative RowStatus (keeps nothing)
//   active        [B] bool: a frozen row (false) keeps nothing
//   token_buffer  [B, S] int64 contiguous, in place: row b's tokens at 0 .. seq_lens[b] - 1
//   seq_lens      [B] int64 contiguous, in place
//   num_kept      [B] int64 contiguous, out
//   next_input    [B, T] int64, T >= 1, any strides, out: column 0 only
// Per row (common/token_commit.h): kept = min(num_accepted + 1, w) if active and num_accepted >= 0,
// else 0; token_buffer[b, seq_lens[b] + j] = tokens[b, j] for j < kept, positions >= S skipped (never
// written out of bounds; the caller sizes S); seq_lens[b] += kept; num_kept[b] = kept;
// next_input[b, 0] = token_buffer[b, seq_lens[b] - 1] (the row's next pending token; every row, frozen
// ones included, as the loop's pending column always holds each row's last token).
// Rows are independent; the op never synchronises with the host (capturable in a CUDA graph).
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "checks.h"
#include "common/op_views.h"

namespace specdec {

inline void check_commit_tokens(const at::Tensor& tokens, const at::Tensor& num_accepted, const at::Tensor& active,
                                const at::Tensor& token_buffer, const at::Tensor& seq_lens,
                                const at::Tensor& num_kept, const at::Tensor& next_input) {
  constexpr const char* op = "commit_tokens";
  check_rank(op, "token_buffer", token_buffer, 2, "[B, S]");
  check_dtype(op, "token_buffer", token_buffer, {at::kLong});
  check_contiguous(op, "token_buffer", token_buffer);
  const int64_t batch = token_buffer.size(0);
  check_rank(op, "tokens", tokens, 2, "[B, w]");
  check_size(op, "tokens", tokens, 0, batch, "B (token_buffer dimension 0)");
  check_dtype(op, "tokens", tokens, {at::kLong});
  check_same_device(op, "tokens", tokens, token_buffer, "token_buffer");
  SPECDEC_CHECK(tokens.size(1) <= 1 || tokens.stride(1) == 1, op, ": tokens must have unit stride along w");
  struct Row {
    const char* name;
    const at::Tensor& t;
    at::ScalarType dtype;
  };
  for (const Row& row : {Row{"num_accepted", num_accepted, at::kInt}, Row{"active", active, at::kBool},
                         Row{"seq_lens", seq_lens, at::kLong}, Row{"num_kept", num_kept, at::kLong}}) {
    check_rank(op, row.name, row.t, 1, "[B]");
    check_size(op, row.name, row.t, 0, batch, "B (token_buffer dimension 0)");
    check_dtype(op, row.name, row.t, {row.dtype});
    check_same_device(op, row.name, row.t, token_buffer, "token_buffer");
    check_contiguous(op, row.name, row.t);
  }
  check_rank(op, "next_input", next_input, 2, "[B, T]");
  check_size(op, "next_input", next_input, 0, batch, "B (token_buffer dimension 0)");
  SPECDEC_CHECK(next_input.size(1) >= 1, op, ": next_input must have at least one column, got shape ",
                shape_str(next_input.sizes()));
  check_dtype(op, "next_input", next_input, {at::kLong});
  check_same_device(op, "next_input", next_input, token_buffer, "token_buffer");
  check_no_internal_overlap(op, "next_input", next_input);
  check_no_internal_overlap(op, "token_buffer", token_buffer);
  check_written_apart(op,
                      {{"token_buffer", &token_buffer}, {"seq_lens", &seq_lens}, {"num_kept", &num_kept},
                       {"next_input", &next_input}},
                      {{"tokens", &tokens}, {"num_accepted", &num_accepted}, {"active", &active}});
}

inline CommitTokensView commit_tokens_view(const at::Tensor& tokens, const at::Tensor& num_accepted,
                                           const at::Tensor& active, const at::Tensor& token_buffer,
                                           const at::Tensor& seq_lens, const at::Tensor& num_kept,
                                           const at::Tensor& next_input) {
  CommitTokensView v;
  v.tokens = tokens.data_ptr<int64_t>();
  v.num_accepted = num_accepted.data_ptr<int32_t>();
  v.active = active.data_ptr<bool>();
  v.token_buffer = token_buffer.data_ptr<int64_t>();
  v.seq_lens = seq_lens.data_ptr<int64_t>();
  v.num_kept = num_kept.data_ptr<int64_t>();
  v.next_input = next_input.data_ptr<int64_t>();
  v.tokens_ld = tokens.stride(0);
  v.next_input_ld = next_input.stride(0);
  v.batch = token_buffer.size(0);
  v.width = tokens.size(1);
  v.capacity = token_buffer.size(1);
  return v;
}

// The schema around a backend's implementation, which gets the raw view of checked, non-empty
// arguments (and the token buffer, for its device).
using CommitTokensImpl = void (*)(const CommitTokensView&, const at::Tensor& token_buffer);

template <CommitTokensImpl Impl>
void commit_tokens_op(const at::Tensor& tokens, const at::Tensor& num_accepted, const at::Tensor& active,
                      at::Tensor& token_buffer, at::Tensor& seq_lens, at::Tensor& num_kept, at::Tensor& next_input) {
  check_commit_tokens(tokens, num_accepted, active, token_buffer, seq_lens, num_kept, next_input);
  if (token_buffer.size(0) > 0) {
    Impl(commit_tokens_view(tokens, num_accepted, active, token_buffer, seq_lens, num_kept, next_input), token_buffer);
  }
}

// Registers a backend's implementation of the family's op under its schema.
template <CommitTokensImpl CommitTokens>
void register_token_buffer_ops(torch::Library& m) {
  m.impl("commit_tokens", &commit_tokens_op<CommitTokens>);
}

}  // namespace specdec
