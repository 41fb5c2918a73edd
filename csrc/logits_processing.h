// Contract of process_logits (issue 28: the OpenAI sampling surface, applied inside verification),
// its raw view and the per-token maths both backends run. Torch-free and CUDA-free: the CPU loop
// (cpu/logits_processing.cpp), the CUDA kernels (cuda/logits_processing.cuh) and the emulated-kernel
// tests (cpp_tests/emulated) include it. The torch side (the argument checks, the view of checked
// tensors, the value errors' messages) is defined in cpu/logits_processing.cpp and declared at the
// end of this file; at::Tensor is only named here, never included.
//
// ---------------------------------------------------------------------------------------------
// process_logits(logits!, draft_tokens, parents?, num_draft, output_counts?, prompt_mask?,
//                logit_bias?, allowed?, presence_penalty?, frequency_penalty?,
//                repetition_penalty?, min_p?, temperature?) -> ()
// ---------------------------------------------------------------------------------------------
// In place on the logits of one verification pass (the target's, or a draft's), per row b and per
// column c:
//   logits             Shape: [B, P, V]  fp32, bf16 or fp16, contiguous; modified in place. The
//                      maths is fp32; the result is stored back in the dtype, rounded to nearest
//                      even (as torch's .to()). Columns c > num_draft[b] are not touched (stale).
//   draft_tokens       Shape: [B, n]     int64, n = P - 1 (n may be 0): a chain's drafts, or a
//                      tree's nodes in topological order. Entries i >= num_draft[b] are not read.
//   parents            Shape: [B, n]     int32, optional: None is a chain; else the tree layout of
//                      tree.h (-1 = a child of the root, -1 <= parents[b, i] < i).
//   num_draft          Shape: [B]        int32 in [0, n]: the drafts row b uses.
//   output_counts      Shape: [B, V]     int32, optional (0): how often each token occurs among row
//                      b's generated tokens so far (the committed ones), in [0, kMaxOutputCount].
//   prompt_mask        Shape: [B, V]     bool, optional (false): the token occurs in row b's prompt.
//   logit_bias         Shape: [B, V]     fp32, optional (0): added to the logit (-inf bans a token; no NaN
//                      or +inf).
//   allowed            Shape: [B, P, W]  int32, optional (all allowed), W = ceil(V / 32): a grammar
//                      bitmask per column in the llguidance / xgrammar layout: token t is allowed at
//                      column c iff bit t % 32 of word allowed[b, c, t / 32] is set (the word read as
//                      uint32). Bits past V are ignored.
//   presence_penalty   Shape: [B]        fp32, optional (0), finite.
//   frequency_penalty  Shape: [B]        fp32, optional (0), finite.
//   repetition_penalty Shape: [B]        fp32, optional (1), finite and > 0.
//   min_p              Shape: [B]        fp32, optional (0 = off), in [0, 1].
//   temperature        Shape: [B]        fp32, optional (1): used by min_p only.
//
// The prefix of a column. Column 0 (the position after the row's pending token) has none: only
// the committed tokens count. For a chain, column c >= 1 follows draft_tokens[b, 0 .. c-1]. For a
// tree, column c >= 1 is the position after node i = c - 1 and its prefix is node i and its
// ancestors (parents walked to -1). Per column:
//   extra[t] = occurrences of t in the prefix,   count[t] = output_counts[b, t] + extra[t],
//   seen[t]  = prompt_mask[b, t] or count[t] > 0.
// Per column, for every token t, in vLLM's order:
//   1. l = logit + logit_bias[t]
//   2. repetition penalty r (HF's semantics): if r != 1 and seen[t]: l = l > 0 ? l / r : l * r
//   3. l = l - (frequency_penalty * count[t] + presence_penalty * (count[t] > 0))   (OpenAI's)
//   4. grammar: if allowed is given and t's bit is clear: l = -inf (a NaN stays NaN)
//   5. min_p, over the column after 1-4, when 0 < min_p and the temperature T is finite and
//      >= kGreedyTemperature (common/sampling_math.h; specdec_ext.ops.GREEDY_TEMPERATURE): with
//      m = the largest finite l of the column, every t with l < m + T * log(min_p) becomes -inf.
//      After softmax(l / T) that is exactly "p(t) < min_p * max_t p(t)". Greedy rows, T = inf and
//      a column without a finite logit are left as they are; min_p = 0 is off.
// Every step is an fp32 operation rounded on its own (no fused multiply-add): add, divide or
// multiply, then frequency * count + presence, then the subtraction; T * logf(min_p) and m + that.
// NaN logits stay NaN (the verifiers report them); a column where every token ends -inf stays so
// (the caller handles grammar dead ends).
//
// Value checks (the same on both backends; each error names the argument): num_draft in [0, n];
// for i < num_draft[b]: draft_tokens[b, i] in [0, V) and -1 <= parents[b, i] < i;
// repetition_penalty finite and > 0; min_p in [0, 1]; presence and frequency penalties finite;
// output_counts in [0, kMaxOutputCount]; logit_bias neither NaN nor +inf.
// The CPU reads them directly; CUDA runs a check kernel and reads one word on the host, except
// during a CUDA graph capture, where nothing can be read: there the values are not checked, and the
// kernel stays in bounds whatever they are (a token id outside [0, V) counts for nothing, a parent
// link that does not point to an earlier node ends the walk).
//
// No-op: with logit_bias, allowed and every penalty and min_p None nothing is read or written.
#pragma once
#include <math.h>

#include <cstdint>
#include <optional>

#include "common/op_views.h"
#include "common/sampling_math.h"

namespace specdec {

// The op's tensors as raw pointers (see common/op_views.h for the other ops' views).
struct ProcessLogitsView {
  void* logits;                      // [B, P, V] of logits_type, in place
  ElementType logits_type;
  const int64_t* draft_tokens;       // [B, n]
  const int32_t* parents;            // [B, n] or null (a chain)
  const int32_t* num_draft;          // [B]
  const int32_t* output_counts;      // [B, V] or null
  const bool* prompt_mask;           // [B, V] or null
  const float* logit_bias;           // [B, V] or null
  const uint32_t* allowed;           // [B, P, W] or null
  const float* presence_penalty;     // [B] or null (0)
  const float* frequency_penalty;    // [B] or null (0)
  const float* repetition_penalty;   // [B] or null (1)
  const float* min_p;                // [B] or null (0)
  const float* temperature;          // [B] or null (1)
  int64_t batch, drafts, vocab, words;  // B, n, V, W

  SPECDEC_HOST_DEVICE int64_t positions() const { return drafts + 1; }
  // The parent of node i of row b (i - 1 for a chain).
  SPECDEC_HOST_DEVICE int64_t parent(int64_t b, int64_t i) const {
    return parents != nullptr ? parents[b * drafts + i] : i - 1;
  }
};

// fp32 operations rounded on their own: under nvcc a + b * c may become one fma otherwise (the host
// builds use -ffp-contract=off; the emulator runs the host path).
SPECDEC_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SPECDEC_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SPECDEC_HOST_DEVICE float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
SPECDEC_HOST_DEVICE bool is_finite_float(float x) { return (float_bits(x) & 0x7F800000u) != 0x7F800000u; }
SPECDEC_HOST_DEVICE bool is_nan_float(float x) { return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
constexpr uint32_t kPositiveInfinityBits = 0x7F800000u;

// One row's processor parameters (the op's defaults where a tensor is absent).
struct RowProcessors {
  float presence, frequency, repetition;
  bool min_p_on;        // 0 < min_p, T finite and >= kGreedyTemperature
  float min_p_offset;   // T * logf(min_p) when min_p_on: the cut is l < m + min_p_offset

  SPECDEC_HOST_DEVICE static RowProcessors of(const ProcessLogitsView& v, int64_t b) {
    RowProcessors r;
    r.presence = v.presence_penalty ? v.presence_penalty[b] : 0.0f;
    r.frequency = v.frequency_penalty ? v.frequency_penalty[b] : 0.0f;
    r.repetition = v.repetition_penalty ? v.repetition_penalty[b] : 1.0f;
    const float min_p = v.min_p ? v.min_p[b] : 0.0f;
    const float t = v.temperature ? v.temperature[b] : 1.0f;
    r.min_p_on = min_p > 0.0f && is_finite_float(t) && t >= kGreedyTemperature;
    r.min_p_offset = r.min_p_on ? mul_rn(t, logf(min_p)) : 0.0f;
    return r;
  }
};

// Steps 1-3 for one token: the raw logit, its bias, count[t] (with the column's extra) and
// prompt_mask[b, t].
SPECDEC_HOST_DEVICE float penalised_logit(float logit, float bias, int32_t count, bool in_prompt,
                                          const RowProcessors& r) {
  float l = add_rn(logit, bias);
  if (r.repetition != 1.0f && (in_prompt || count > 0)) l = l > 0.0f ? l / r.repetition : mul_rn(l, r.repetition);
  const float penalty = add_rn(mul_rn(r.frequency, static_cast<float>(count)), count > 0 ? r.presence : 0.0f);
  return sub_rn(l, penalty);
}

// Whether token t is allowed by a column's bitmask row (null: every token).
SPECDEC_HOST_DEVICE bool token_allowed(const uint32_t* column_words, int64_t t) {
  return column_words == nullptr || ((column_words[t >> 5] >> (t & 31)) & 1u) != 0u;
}

// Steps 1-4 for token t of row b at a column whose bitmask row is column_words, with `extra`
// occurrences of t in the column's prefix.
SPECDEC_HOST_DEVICE float processed_logit(const ProcessLogitsView& v, const RowProcessors& r, int64_t b,
                                          const uint32_t* column_words, int64_t t, float raw, int32_t extra) {
  const int64_t bt = b * v.vocab + t;
  const float bias = v.logit_bias ? v.logit_bias[bt] : 0.0f;
  const int32_t count = (v.output_counts ? v.output_counts[bt] : 0) + extra;
  const bool in_prompt = v.prompt_mask ? v.prompt_mask[bt] : false;
  const float l = penalised_logit(raw, bias, count, in_prompt, r);
  return token_allowed(column_words, t) || is_nan_float(l) ? l : -INFINITY;
}

// Step 5 for one logit: the column's largest finite logit m given.
SPECDEC_HOST_DEVICE float min_p_cut(float l, float column_max, const RowProcessors& r) {
  return l < add_rn(column_max, r.min_p_offset) ? -INFINITY : l;
}

// Whether the call changes anything at all (the no-op fast path when not).
inline bool processes_anything(const ProcessLogitsView& v) {
  return v.logit_bias || v.allowed || v.presence_penalty || v.frequency_penalty || v.repetition_penalty || v.min_p;
}

// The largest output count: count[t] adds at most n drafts to it, which must not overflow an int32.
constexpr int32_t kMaxOutputCount = 1 << 30;

// The value errors of row b, as bits (ProcessLogitsError); 0 when its values are valid.
enum ProcessLogitsError : uint32_t {
  kErrorNumDraft = 1u << 0,
  kErrorDraftTokens = 1u << 1,
  kErrorParents = 1u << 2,
  kErrorRepetitionPenalty = 1u << 3,
  kErrorMinP = 1u << 4,
  kErrorPresencePenalty = 1u << 5,
  kErrorFrequencyPenalty = 1u << 6,
  kErrorOutputCounts = 1u << 7,
  kErrorLogitBias = 1u << 8,
};

SPECDEC_HOST_DEVICE uint32_t row_value_errors(const ProcessLogitsView& v, int64_t b) {
  uint32_t errors = 0;
  const int32_t used = v.num_draft[b];
  if (used < 0 || used > v.drafts) {
    errors |= kErrorNumDraft;
  } else {
    for (int64_t i = 0; i < used; ++i) {
      const int64_t token = v.draft_tokens[b * v.drafts + i];
      if (token < 0 || token >= v.vocab) errors |= kErrorDraftTokens;
      if (v.parents != nullptr) {
        const int32_t parent = v.parents[b * v.drafts + i];
        if (parent < -1 || parent >= i) errors |= kErrorParents;
      }
    }
  }
  if (v.repetition_penalty && !(is_finite_float(v.repetition_penalty[b]) && v.repetition_penalty[b] > 0.0f))
    errors |= kErrorRepetitionPenalty;
  if (v.min_p && !(v.min_p[b] >= 0.0f && v.min_p[b] <= 1.0f)) errors |= kErrorMinP;
  if (v.presence_penalty && !is_finite_float(v.presence_penalty[b])) errors |= kErrorPresencePenalty;
  if (v.frequency_penalty && !is_finite_float(v.frequency_penalty[b])) errors |= kErrorFrequencyPenalty;
  return errors;
}

// The [B, V] tables' errors among their elements [begin, end) (flattened; a backend spreads the elements
// over its threads): kErrorOutputCounts for an output count outside [0, kMaxOutputCount], kErrorLogitBias
// for a NaN or +inf bias (it would make the logit NaN or +inf, which the verifier blames on the logits).
SPECDEC_HOST_DEVICE uint32_t table_errors(const ProcessLogitsView& v, int64_t begin, int64_t end, int64_t step) {
  bool bad_count = false, bad_bias = false;
  if (v.output_counts != nullptr) {
    for (int64_t i = begin; i < end; i += step) {
      bad_count |= v.output_counts[i] < 0 || v.output_counts[i] > kMaxOutputCount;
    }
  }
  if (v.logit_bias != nullptr) {
    for (int64_t i = begin; i < end; i += step) {
      bad_bias |= is_nan_float(v.logit_bias[i]) || float_bits(v.logit_bias[i]) == kPositiveInfinityBits;
    }
  }
  return (bad_count ? kErrorOutputCounts : 0u) | (bad_bias ? kErrorLogitBias : 0u);
}

}  // namespace specdec

// ---------------------------------------------------------------------------------------------
// The torch side, defined in cpu/logits_processing.cpp (both backends call it; at::Tensor is only
// named here).
namespace at {
class Tensor;
}

namespace specdec {

struct ProcessLogitsArgs {
  const at::Tensor& logits;
  const at::Tensor& draft_tokens;
  const std::optional<at::Tensor>& parents;
  const at::Tensor& num_draft;
  const std::optional<at::Tensor>& output_counts;
  const std::optional<at::Tensor>& prompt_mask;
  const std::optional<at::Tensor>& logit_bias;
  const std::optional<at::Tensor>& allowed;
  const std::optional<at::Tensor>& presence_penalty;
  const std::optional<at::Tensor>& frequency_penalty;
  const std::optional<at::Tensor>& repetition_penalty;
  const std::optional<at::Tensor>& min_p;
  const std::optional<at::Tensor>& temperature;
};

// The shape, dtype, device and contiguity checks (errors name the argument), then the raw view.
ProcessLogitsView check_process_logits(const ProcessLogitsArgs& args);
// Raises the error of the first bit set in `errors` (row_value_errors of every row, or-ed); the
// message names the argument. No-op for 0.
void raise_process_logits_value_errors(uint32_t errors, const ProcessLogitsView& view);

// The schema around a backend's implementation, which gets the checked arguments and their view
// (B > 0, something to do) and checks the values itself (row_value_errors).
template <void (*Impl)(const ProcessLogitsArgs&, const ProcessLogitsView&)>
void process_logits_op(at::Tensor& logits, const at::Tensor& draft_tokens, const std::optional<at::Tensor>& parents,
                       const at::Tensor& num_draft, const std::optional<at::Tensor>& output_counts,
                       const std::optional<at::Tensor>& prompt_mask, const std::optional<at::Tensor>& logit_bias,
                       const std::optional<at::Tensor>& allowed, const std::optional<at::Tensor>& presence_penalty,
                       const std::optional<at::Tensor>& frequency_penalty,
                       const std::optional<at::Tensor>& repetition_penalty, const std::optional<at::Tensor>& min_p,
                       const std::optional<at::Tensor>& temperature) {
  const ProcessLogitsArgs args{logits,      draft_tokens,     parents,           num_draft,          output_counts,
                               prompt_mask, logit_bias,       allowed,           presence_penalty,   frequency_penalty,
                               repetition_penalty,            min_p,             temperature};
  const ProcessLogitsView view = check_process_logits(args);
  if (view.batch > 0 && processes_anything(view)) Impl(args, view);
}

// Registers a backend's implementation under the schema (Library: torch::Library).
template <void (*Impl)(const ProcessLogitsArgs&, const ProcessLogitsView&), typename Library>
void register_process_logits(Library& m) {
  m.impl("process_logits", &process_logits_op<Impl>);
}

}  // namespace specdec
