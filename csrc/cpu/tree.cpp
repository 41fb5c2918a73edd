// CPU backend of the tree family (contract and per-row semantics in ../tree.h): one row per task
// of at::parallel_for; tree_verify reuses chain_verify's TargetDistribution (distribution.h), so
// filtering, acceptance, residuals and sampling are the same code for chains and trees.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "../tree.h"
#include "distribution.h"

namespace specdec::cpu {
namespace {

// Status of a row's tree (0, kStatusNumNodesOutOfRange or kStatusInvalidTree), tree.h.
int32_t validate_tree(const int32_t* row_parents, int64_t n, int64_t nodes) {
  if (n < 0 || n > nodes) return kStatusNumNodesOutOfRange;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t parent = row_parents[i];
    if (parent < -1 || parent >= i) return kStatusInvalidTree;
  }
  return 0;
}

void build_tree_mask(const at::Tensor& parents, const std::optional<at::Tensor>& num_nodes,
                     at::Tensor& mask, at::Tensor& depth) {
  check_build_tree_mask(parents, num_nodes, mask, depth);
  const int64_t batch = parents.size(0);
  const int64_t nodes = parents.size(1);
  if (batch == 0 || nodes == 0) return;
  const int32_t* par = parents.data_ptr<int32_t>();
  const int32_t* counts = num_nodes ? num_nodes->data_ptr<int32_t>() : nullptr;
  bool* m = mask.data_ptr<bool>();
  int32_t* dep = depth.data_ptr<int32_t>();

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int32_t* row_parents = par + b * nodes;
      bool* row_mask = m + b * nodes * nodes;
      int32_t* row_depth = dep + b * nodes;
      const int64_t n = counts ? counts[b] : nodes;
      std::fill(row_mask, row_mask + nodes * nodes, false);
      const int32_t status = validate_tree(row_parents, n, nodes);
      if (status != 0) {
        std::fill(row_depth, row_depth + nodes, status);
        continue;
      }
      for (int64_t i = 0; i < nodes; ++i) {
        bool* mask_i = row_mask + i * nodes;
        if (i >= n) {  // unused slot: sees only itself
          row_depth[i] = 0;
          mask_i[i] = true;
          continue;
        }
        const int32_t parent = row_parents[i];
        if (parent >= 0) {  // the parent's row holds its ancestors, all below i
          std::copy(row_mask + parent * nodes, row_mask + parent * nodes + parent + 1, mask_i);
          row_depth[i] = row_depth[parent] + 1;
        } else {
          row_depth[i] = 1;
        }
        mask_i[i] = true;
      }
    }
  });
}

template <typename scalar_t>
void tree_verify_rows(const TreeVerifyArgs& a) {
  const int64_t batch = a.target_logits.size(0);
  const int64_t nodes = a.target_logits.size(1) - 1;
  const int64_t vocab = a.target_logits.size(2);
  const scalar_t* logits = a.target_logits.data_ptr<scalar_t>();
  const int64_t* token_ids = a.tree_token_ids.data_ptr<int64_t>();
  const int32_t* par = a.parents.data_ptr<int32_t>();
  const float* draft_probs = a.draft_probs ? a.draft_probs->data_ptr<float>() : nullptr;
  const int32_t* counts = a.num_nodes ? a.num_nodes->data_ptr<int32_t>() : nullptr;
  const float* uniforms = a.uniforms ? a.uniforms->data_ptr<float>() : nullptr;
  const int64_t* seed = a.seed ? a.seed->data_ptr<int64_t>() : nullptr;
  const int64_t* offset = a.offset ? a.offset->data_ptr<int64_t>() : nullptr;
  int32_t* path = a.path.data_ptr<int32_t>();
  int64_t* tokens = a.tokens.data_ptr<int64_t>();
  int32_t* num_accepted = a.num_accepted.data_ptr<int32_t>();

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    TargetDistribution dist(vocab);
    for (int64_t b = begin; b < end; ++b) {
      int32_t* row_path = path + b * nodes;
      int64_t* row_tokens = tokens + b * (nodes + 1);
      const int32_t* row_parents = par + b * nodes;
      const int64_t* row_ids = token_ids + b * nodes;
      std::fill(row_path, row_path + nodes, kEmptySlot);
      std::fill(row_tokens, row_tokens + nodes + 1, static_cast<int64_t>(kEmptySlot));
      auto uniform = [&](int64_t column) {
        return uniforms ? uniforms[b * (nodes + 1) + column]
                        : philox_uniform(seed[b], offset ? offset[b] : 0, column);
      };
      const FilterParams filter = read_filter(a.temperature, a.top_k, a.top_p, b);
      const int64_t n = counts ? counts[b] : nodes;
      int32_t status = validate_filter(filter);
      if (status == 0) status = validate_tree(row_parents, n, nodes);
      for (int64_t c = 0; status == 0 && c <= nodes; ++c) {
        if (!is_valid_uniform(uniform(c))) status = kStatusInvalidUniform;
      }
      for (int64_t i = 0; status == 0 && i < n; ++i) {
        if (row_ids[i] < 0 || row_ids[i] >= vocab) status = kStatusDraftTokenOutOfRange;
      }

      int64_t accepted = 0;  // the depth of `current`
      int64_t current = -1;  // the root: the committed token
      int64_t emitted = -1;
      while (status == 0) {
        status = dist.load(logits + (b * (nodes + 1) + current + 1) * vocab, filter);
        if (status != 0) break;
        int64_t next = -1;
        // Children of `current` lie after it (topological order), in increasing index order.
        for (int64_t c = current + 1; c < n; ++c) {
          if (row_parents[c] != current) continue;
          const int64_t x = row_ids[c];
          const float* q_row = draft_probs ? draft_probs + (b * nodes + c) * vocab : nullptr;
          const float q = q_row ? q_row[x] : 1.0f;
          if (!(q >= 0.0f && q <= 1.0f)) {
            status = kStatusInvalidDraftProbs;
            break;
          }
          if (accept_draft(uniform(c), dist.prob(x), q)) {
            next = c;
            break;
          }
          status = dist.subtract(q_row, x);  // the next child is tried against the residual
          if (status != 0) break;
        }
        if (status != 0) break;
        if (next < 0) {  // every child rejected, or a leaf: recovered or bonus token
          emitted = dist.sample(uniform(nodes));
          break;
        }
        row_path[accepted] = static_cast<int32_t>(next);
        row_tokens[accepted] = row_ids[next];
        ++accepted;
        current = next;
      }
      if (status != 0) {
        std::fill(row_path, row_path + nodes, kEmptySlot);
        std::fill(row_tokens, row_tokens + nodes + 1, static_cast<int64_t>(kEmptySlot));
        num_accepted[b] = status;
        continue;
      }
      row_tokens[accepted] = emitted;
      num_accepted[b] = static_cast<int32_t>(accepted);
    }
  });
}

void tree_verify(const at::Tensor& target_logits, const at::Tensor& tree_token_ids,
                 const at::Tensor& parents, const std::optional<at::Tensor>& draft_probs,
                 const std::optional<at::Tensor>& num_nodes,
                 const std::optional<at::Tensor>& temperature,
                 const std::optional<at::Tensor>& top_k, const std::optional<at::Tensor>& top_p,
                 const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                 const std::optional<at::Tensor>& uniforms, at::Tensor& path, at::Tensor& tokens,
                 at::Tensor& num_accepted) {
  const TreeVerifyArgs args{target_logits, tree_token_ids, parents, draft_probs, num_nodes,
                            temperature,   top_k,          top_p,   seed,        offset,
                            uniforms,      path,           tokens,  num_accepted};
  check_tree_verify(args);
  if (target_logits.size(0) == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, target_logits.scalar_type(),
                                  "tree_verify_cpu", [&] { tree_verify_rows<scalar_t>(args); });
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) {
  m.impl("build_tree_mask", &build_tree_mask);
  m.impl("tree_verify", &tree_verify);
}

}  // namespace specdec::cpu
