// CPU backend of the tree family (contract and per-row semantics in ../tree.h): one row per task
// of at::parallel_for; tree_verify shares chain_verify's row (verifier_row.h) and distribution
// (distribution.h), so filtering, acceptance, residuals and sampling are the same code for chains
// and trees.
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>

#include "../tree.h"
#include "distribution.h"
#include "verifier_row.h"

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
  const TreeMaskView v = tree_mask_view(parents, num_nodes, mask, depth);
  const int64_t nodes = v.nodes;
  at::parallel_for(0, v.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int32_t* row_parents = v.parents + b * nodes;
      bool* row_mask = v.mask + b * nodes * nodes;
      int32_t* row_depth = v.depth + b * nodes;
      const int64_t n = v.num_nodes ? v.num_nodes[b] : nodes;
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
void tree_verify_rows(const TreeVerifyView& v) {
  const int64_t nodes = v.drafts;
  for_each_verifier_row(v, [&](VerifierRow& row, TargetDistribution& p) {
    const int64_t n = row.count();
    const int32_t* row_parents = v.parents + row.index() * nodes;
    int32_t* row_path = v.path + row.index() * nodes;
    std::fill(row_path, row_path + nodes, kEmptySlot);
    int32_t status = row.start_status([&] { return validate_tree(row_parents, n, nodes); });

    int64_t accepted = 0;  // the depth of `current`
    int64_t current = -1;  // the root: the committed token
    int64_t emitted = -1;
    while (status == 0) {
      status = p.load(row.logits<scalar_t>(current + 1), row.filter());
      if (status != 0) break;
      int64_t next = -1;
      // Children of `current` lie after it (topological order), in increasing index order; each
      // rejected one leaves p as the residual the next child is tried against.
      for (int64_t c = current + 1; c < n && status == 0; ++c) {
        if (row_parents[c] == current && row.accept_or_subtract(p, c, status)) {
          next = c;
          break;
        }
      }
      if (status != 0) break;
      if (next < 0) {  // every child rejected, or a leaf: recovered or bonus token
        emitted = p.sample(row.draw(n));
        break;
      }
      row_path[accepted] = static_cast<int32_t>(next);
      row.set_token(accepted, row.token_id(next));
      ++accepted;
      current = next;
    }
    if (row.finish(status, accepted, emitted) != 0) std::fill(row_path, row_path + nodes, kEmptySlot);
  });
}

void tree_verify(const TreeVerifyArgs& args) {
  const TreeVerifyView view = tree_verify_view(args);
  AT_DISPATCH_V2(args.verifier.target_logits.scalar_type(), "tree_verify_cpu",
                 AT_WRAP([&] { tree_verify_rows<scalar_t>(view); }), at::kFloat, at::kBFloat16, at::kHalf);
}

}  // namespace

TORCH_LIBRARY_IMPL(specdec_ext, CPU, m) { register_tree_ops<build_tree_mask, tree_verify>(m); }

}  // namespace specdec::cpu
