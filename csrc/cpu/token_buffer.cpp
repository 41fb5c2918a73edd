// CPU backend of the token buffer family (contract in ../token_buffer.h): the rows in order, each by
// commit_row (common/token_commit.h), the same code the CUDA kernel runs per row. A step commits a
// handful of tokens per row: no threads.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../common/token_commit.h"
#include "../token_buffer.h"

namespace specdec::cpu {
namespace {

void commit_tokens(const CommitTokensView& view, const at::Tensor& /*token_buffer*/) {
  for (int64_t b = 0; b < view.batch; ++b) commit_row(view, b);
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) { register_token_buffer_ops<commit_tokens>(m); }

}  // namespace specdec::cpu
