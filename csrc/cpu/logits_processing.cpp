// CPU backend of process_logits (contract and per-token maths in ../logits_processing.h), and the
// torch side both backends share: the argument checks, the raw view and the value errors' messages.
// One (row, column) per task of at::parallel_for: the column is processed into a per-thread fp32
// scratch row with the committed counts, the tokens of its prefix are redone from their raw logits
// with the prefix's extra counts, min_p cuts the scratch row, and it is stored back in the dtype.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../checks.h"
#include "../logits_processing.h"
#include "../tensor_data.h"

namespace specdec {

namespace {

constexpr const char* kOp = "process_logits";

// An optional [B, X] (or [B, P, W]) tensor of one dtype beside logits.
void check_optional_matrix(const char* name, const std::optional<at::Tensor>& t, const char* layout, int64_t rows,
                           int64_t columns, const char* columns_what, at::ScalarType dtype,
                           const at::Tensor& logits) {
  if (!t.has_value()) return;
  check_matrix(kOp, name, *t, layout, rows, "B", columns, columns_what, dtype, logits, "logits");
}

}  // namespace

ProcessLogitsView check_process_logits(const ProcessLogitsArgs& a) {
  const at::Tensor& logits = a.logits;
  check_rank(kOp, "logits", logits, 3, "[B, P, V]");
  check_dtype(kOp, "logits", logits, {at::kFloat, at::kBFloat16, at::kHalf});
  check_contiguous(kOp, "logits", logits);
  const int64_t batch = logits.size(0), positions = logits.size(1), vocab = logits.size(2);
  SPECDEC_CHECK(positions >= 1, kOp, ": logits must have P >= 1 positions, got shape ", shape_str(logits.sizes()));
  SPECDEC_CHECK(vocab >= 1, kOp, ": logits must have a vocabulary of at least 1 token");
  const int64_t drafts = positions - 1;
  const int64_t words = (vocab + 31) / 32;
  check_matrix(kOp, "draft_tokens", a.draft_tokens, "[B, n]", batch, "B", drafts,
               "n = P - 1 (logits has P positions)", at::kLong, logits, "logits");
  check_optional_matrix("parents", a.parents, "[B, n]", batch, drafts, "n = P - 1 (logits has P positions)",
                        at::kInt, logits);
  check_row_param(kOp, "num_draft", a.num_draft, batch, at::kInt, logits, "logits");
  check_optional_matrix("output_counts", a.output_counts, "[B, V]", batch, vocab, "V (logits dimension 2)",
                        at::kInt, logits);
  check_optional_matrix("prompt_mask", a.prompt_mask, "[B, V]", batch, vocab, "V (logits dimension 2)", at::kBool,
                        logits);
  check_optional_matrix("logit_bias", a.logit_bias, "[B, V]", batch, vocab, "V (logits dimension 2)", at::kFloat,
                        logits);
  if (a.allowed.has_value()) {
    const at::Tensor& allowed = *a.allowed;
    check_rank(kOp, "allowed", allowed, 3, "[B, P, W]");
    check_size(kOp, "allowed", allowed, 0, batch, "B");
    check_size(kOp, "allowed", allowed, 1, positions, "P (logits dimension 1)");
    check_size(kOp, "allowed", allowed, 2, words, "W = ceil(V / 32)");
    check_dtype(kOp, "allowed", allowed, {at::kInt});
    check_same_device(kOp, "allowed", allowed, logits, "logits");
    check_contiguous(kOp, "allowed", allowed);
  }
  const auto row_param = [&](const char* name, const std::optional<at::Tensor>& t) {
    check_row_param(kOp, name, t, batch, at::kFloat, logits, "logits");
  };
  row_param("presence_penalty", a.presence_penalty);
  row_param("frequency_penalty", a.frequency_penalty);
  row_param("repetition_penalty", a.repetition_penalty);
  row_param("min_p", a.min_p);
  row_param("temperature", a.temperature);

  ProcessLogitsView v;
  v.logits = logits.data_ptr();
  v.logits_type = element_type(logits);
  v.draft_tokens = a.draft_tokens.data_ptr<int64_t>();
  v.parents = optional_data<int32_t>(a.parents);
  v.num_draft = a.num_draft.data_ptr<int32_t>();
  v.output_counts = optional_data<int32_t>(a.output_counts);
  v.prompt_mask = optional_data<bool>(a.prompt_mask);
  v.logit_bias = optional_data<float>(a.logit_bias);
  v.allowed = reinterpret_cast<const uint32_t*>(optional_data<int32_t>(a.allowed));
  v.presence_penalty = optional_data<float>(a.presence_penalty);
  v.frequency_penalty = optional_data<float>(a.frequency_penalty);
  v.repetition_penalty = optional_data<float>(a.repetition_penalty);
  v.min_p = optional_data<float>(a.min_p);
  v.temperature = optional_data<float>(a.temperature);
  v.batch = batch;
  v.drafts = drafts;
  v.vocab = vocab;
  v.words = words;
  return v;
}

void raise_process_logits_value_errors(uint32_t errors, const ProcessLogitsView& v) {
  if (errors == 0) return;
  SPECDEC_CHECK(!(errors & kErrorNumDraft), kOp, ": num_draft must hold values in [0, n] = [0, ", v.drafts,
                "] (logits has n+1 positions)");
  SPECDEC_CHECK(!(errors & kErrorDraftTokens), kOp, ": draft_tokens must hold token ids in [0, V) = [0, ", v.vocab,
              ") at every used position (i < num_draft[b])");
  SPECDEC_CHECK(!(errors & kErrorParents), kOp,
                ": parents must describe a tree in topological order: -1 <= parents[b, i] < i for every used node "
                "(i < num_draft[b])");
  SPECDEC_CHECK(!(errors & kErrorRepetitionPenalty), kOp, ": repetition_penalty must be finite and > 0");
  SPECDEC_CHECK(!(errors & kErrorMinP), kOp, ": min_p must lie in [0, 1]");
  SPECDEC_CHECK(!(errors & kErrorPresencePenalty), kOp, ": presence_penalty must be finite");
  SPECDEC_CHECK(!(errors & kErrorFrequencyPenalty), kOp, ": frequency_penalty must be finite");
  SPECDEC_CHECK(!(errors & kErrorOutputCounts), kOp, ": output_counts must lie in [0, ", kMaxOutputCount, "]");
  SPECDEC_CHECK(!(errors & kErrorLogitBias), kOp, ": logit_bias must hold no NaN or +inf (-inf bans a token)");
  SPECDEC_CHECK(false, kOp, ": invalid values (error bits ", errors, ")");
}

namespace cpu {
namespace {

// Column c of row b: `column` the logits row [V] (in place), `out` fp32 scratch [V], `path` scratch.
template <typename scalar_t>
void process_column(const ProcessLogitsView& v, int64_t b, int64_t c, scalar_t* column, float* out,
                    std::vector<int64_t>& path) {
  const int64_t vocab = v.vocab;
  const RowProcessors r = RowProcessors::of(v, b);
  const uint32_t* words = v.allowed ? v.allowed + (b * v.positions() + c) * v.words : nullptr;
  // The prefix: node c - 1 and its ancestors (a chain: drafts 0 .. c-1).
  path.clear();
  for (int64_t i = c - 1; i >= 0;) {
    const int64_t token = v.draft_tokens[b * v.drafts + i];
    if (token >= 0 && token < vocab) path.push_back(token);
    const int64_t next = v.parent(b, i);
    if (next >= i) break;  // (checked before: never taken)
    i = next;
  }
  std::sort(path.begin(), path.end());
  // Every token with the committed counts, reading the raw logits (nothing is written yet) ...
  for (int64_t t = 0; t < vocab; ++t) out[t] = processed_logit(v, r, b, words, t, static_cast<float>(column[t]), 0);
  // ... then the prefix's tokens again, from their raw logits, with their extra counts.
  for (size_t j = 0; j < path.size();) {
    size_t k = j;
    while (k < path.size() && path[k] == path[j]) ++k;
    const int64_t t = path[j];
    out[t] = processed_logit(v, r, b, words, t, static_cast<float>(column[t]), static_cast<int32_t>(k - j));
    j = k;
  }
  if (r.min_p_on) {
    float column_max = -INFINITY;
    for (int64_t t = 0; t < vocab; ++t) {
      if (is_finite_float(out[t]) && out[t] > column_max) column_max = out[t];
    }
    for (int64_t t = 0; t < vocab; ++t) out[t] = min_p_cut(out[t], column_max, r);
  }
  for (int64_t t = 0; t < vocab; ++t) column[t] = static_cast<scalar_t>(out[t]);
}

template <typename scalar_t>
void process_columns(const ProcessLogitsView& v) {
  const int64_t positions = v.positions();
  scalar_t* logits = static_cast<scalar_t*>(v.logits);
  at::parallel_for(0, v.batch * positions, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> out(static_cast<size_t>(v.vocab));
    std::vector<int64_t> path;
    for (int64_t bc = begin; bc < end; ++bc) {
      const int64_t b = bc / positions, c = bc % positions;
      if (c > v.num_draft[b]) continue;  // stale
      process_column(v, b, c, logits + bc * v.vocab, out.data(), path);
    }
  });
}

void process_logits(const ProcessLogitsArgs& args, const ProcessLogitsView& view) {
  uint32_t errors = 0;
  for (int64_t b = 0; b < view.batch; ++b) errors |= row_value_errors(view, b);
  errors |= table_errors(view, 0, view.batch * view.vocab, 1);
  raise_process_logits_value_errors(errors, view);
  AT_DISPATCH_V2(args.logits.scalar_type(), "process_logits_cpu", AT_WRAP([&] { process_columns<scalar_t>(view); }),
                 at::kFloat, at::kBFloat16, at::kHalf);
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) { register_process_logits<process_logits>(m); }

}  // namespace cpu
}  // namespace specdec
