// Every op's tensors as raw pointers and sizes: the one form that the CPU loops, the CUDA kernels,
// their launches (cuda/<family>.cu) and the emulated-kernel tests (cpp_tests/emulated) share.
// No torch and no CUDA here; csrc/<family>.h builds these views from checked tensors.
#pragma once
#include <cstdint>

#include "philox.h"
#include "sampling_math.h"

namespace specdec {

// Element type of logits, probabilities and KV pools (the kernels accumulate in fp32 whatever it is).
enum class ElementType : int32_t { kFloat32, kFloat16, kBFloat16 };

// The per-row sampling arguments of every verifier: [B] pointers, null for the default.
struct SamplingParams {
  const float* temperature;  // null: 1
  const int32_t* top_k;      // null: 0 (off)
  const float* top_p;        // null: 1 (off)
  const int64_t* seed;       // Philox key per row; null: no Philox draws
  const int64_t* offset;     // Philox counter per row; null: 0
  const float* uniforms;     // [B, draws]: explicit draws instead of Philox, or null
  int64_t draws;             // draws per row: the width of uniforms

  SPECDEC_HOST_DEVICE FilterParams filter(int64_t row) const {
    FilterParams f;
    f.temperature = temperature ? temperature[row] : 1.0f;
    f.top_k = top_k ? top_k[row] : 0;
    f.top_p = top_p ? top_p[row] : 1.0f;
    return f;
  }
  SPECDEC_HOST_DEVICE bool has_draws() const { return uniforms != nullptr || seed != nullptr; }
  // Draw `column` of `row`. Without any source it is 0: only greedy rows get that far (the others
  // stop at kStatusMissingRandomness), and their one-hot decisions come out the same for any draw.
  SPECDEC_HOST_DEVICE float draw(int64_t row, int64_t column) const {
    if (uniforms != nullptr) return uniforms[row * draws + column];
    if (seed != nullptr) return philox_uniform(seed[row], offset != nullptr ? offset[row] : 0, column);
    return 0.0f;
  }
  // kStatusMissingRandomness for a sampling row with no draws, else 0 (the draws' own range is
  // checked column by column: is_valid_uniform).
  SPECDEC_HOST_DEVICE int32_t missing_draws_status(const FilterParams& f) const {
    return has_draws() || is_greedy(f.temperature) ? 0 : kStatusMissingRandomness;
  }
};

// What chain_verify and tree_verify share (csrc/verifier.h): logits [B, n+1, V], the drafted token
// of each of n slots, their draft distributions, a per-row count of used slots, the sampling
// arguments and the outputs tokens [B, n+1], num_accepted [B]. n is k for chains, N for trees.
struct VerifierView {
  const void* logits;         // [B, n+1, V] of logits_type
  ElementType logits_type;
  const int64_t* token_ids;   // [B, n]: draft_token_ids / tree_token_ids
  const float* draft_probs;   // [B, n, V] or null (deterministic drafts)
  const int32_t* counts;      // [B] or null (n): num_draft / num_nodes
  SamplingParams sampling;    // draws = n + 1
  int64_t* tokens;            // [B, n+1] out
  int32_t* num_accepted;      // [B] out
  int64_t batch, drafts, vocab;

  SPECDEC_HOST_DEVICE int64_t row_count(int64_t row) const { return counts ? counts[row] : drafts; }
};

using ChainVerifyView = VerifierView;

struct TreeVerifyView : VerifierView {
  const int32_t* parents;  // [B, N]
  int32_t* path;           // [B, N] out
};

struct ResidualProbsView {
  const void* target_probs;  // [rows, V] of probs_type
  const void* draft_probs;   // [rows, V] of probs_type
  ElementType probs_type;
  float* out;                // [rows, V]
  int64_t rows, vocab;
};

// sample_filtered: each row's filtered distribution (the verifiers' filter) written out, and one
// token drawn from it.
struct SampleFilteredView {
  const void* logits;        // [B, V] of logits_type
  ElementType logits_type;
  SamplingParams sampling;   // draws = 1
  float* probs;              // [B, V] out: row b starts at probs + b * probs_row_stride
  int64_t probs_row_stride;  // >= V (a column of a [B, k, V] buffer has k * V)
  int64_t* tokens;           // [B] out: the drawn token, or a negative RowStatus
  int64_t batch, vocab;
};

struct PhiloxUniformsView {
  const int64_t* seed;    // [rows]
  const int64_t* offset;  // [rows]
  float* out;             // [rows, columns]
  int64_t rows, columns;
};

struct TreeMaskView {
  const int32_t* parents;    // [B, N]
  const int32_t* num_nodes;  // [B] or null (N)
  bool* mask;                // [B, N, N] out
  int32_t* depth;            // [B, N] out
  int64_t batch, nodes;
};

// Elements are moved as raw words of word_bytes (2 or 4): the KV ops copy, they never compute.
struct KvWriteView {
  const void* key;             // [B, T, H, D], strides key_strides (elements)
  const void* value;           // [B, T, H, D], strides value_strides
  int64_t key_strides[4];
  int64_t value_strides[4];
  const int64_t* slot_mapping; // [B, T]
  void* pool;                  // [2, num_pages, page_size, H, D]
  int64_t batch, tokens, heads, head_dim, num_slots;
  int32_t word_bytes;
};

struct KvCompactView {
  void* pool;                    // [X, num_pages, page_size, H, D]
  const int32_t* block_tables;   // [B, P]
  const int64_t* src_positions;  // [B, M]
  const int64_t* dst_start;      // [B]
  int64_t planes, num_pages, page_size, slot_elems, batch, max_pages, positions;
  int32_t word_bytes;
};

// commit_tokens (token_buffer.h): the step's emitted tokens into each row's token buffer.
struct CommitTokensView {
  const int64_t* tokens;        // [B, w], rows tokens_ld apart
  const int32_t* num_accepted;  // [B]
  const bool* active;           // [B]
  int64_t* token_buffer;        // [B, S] in place
  int64_t* seq_lens;            // [B] in place
  int64_t* num_kept;            // [B] out
  int64_t* next_input;          // [B, *] out (column 0), rows next_input_ld apart
  int64_t tokens_ld, next_input_ld, batch, width, capacity;
};

}  // namespace specdec
