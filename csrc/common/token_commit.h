// commit_tokens' per-row semantics (contract in ../token_buffer.h), one definition for the CPU loop
// (cpu/token_buffer.cpp) and the CUDA kernel (cuda/token_buffer.cuh): both call commit_row for each row.
#pragma once
#include <cstdint>

#include "op_views.h"

namespace specdec {

// Row b keeps kept = num_accepted[b] + 1 tokens (at most w) when it is active and its verdict valid
// (num_accepted >= 0), else none; they are written at seq_lens[b] .. seq_lens[b] + kept - 1 (positions
// past the buffer are skipped, never written), seq_lens[b] grows by kept, and next_input[b, 0] becomes
// the row's last token (token_buffer[b, seq_lens[b] - 1], when that is inside the buffer).
SPECDEC_HOST_DEVICE void commit_row(const CommitTokensView& v, int64_t b) {
  const int32_t accepted = v.num_accepted[b];
  int64_t kept = v.active[b] && accepted >= 0 ? static_cast<int64_t>(accepted) + 1 : 0;
  if (kept > v.width) kept = v.width;
  const int64_t* row_tokens = v.tokens + b * v.tokens_ld;
  int64_t* row_buffer = v.token_buffer + b * v.capacity;
  const int64_t start = v.seq_lens[b];
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t position = start + j;
    if (position >= 0 && position < v.capacity) row_buffer[position] = row_tokens[j];
  }
  const int64_t length = start + kept;
  v.seq_lens[b] = length;
  v.num_kept[b] = kept;
  if (length >= 1 && length <= v.capacity) v.next_input[b * v.next_input_ld] = row_buffer[length - 1];
}

}  // namespace specdec
