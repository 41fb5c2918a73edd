// Contract of the tree family: build_tree_mask and tree_verify. Both backends (cpu/tree.cpp,
// cuda/tree.cu) call the check_*() functions here before touching data, and implement exactly the
// per-row semantics written below.
//
// ---------------------------------------------------------------------------------------------
// Tree layout (used by every tree op, the Python helpers and the decode loop)
// ---------------------------------------------------------------------------------------------
//   parents   [B, N] int32   parents[b, i] is the index (among the row's nodes) of node i's parent,
//                            or -1 when node i is a child of the root, the last committed token.
//                            Nodes are in topological order: -1 <= parents[b, i] < i.
//   num_nodes [B] int32, optional (default N): row b uses nodes 0 .. num_nodes[b]-1; the slots
//                            i >= num_nodes[b] are unused and their parents/token ids are ignored
//                            (never read). 0 <= num_nodes[b] <= N.
//   The depth of a node is 1 for a child of the root and depth(parent) + 1 otherwise; the root
//   itself (the committed token) has depth 0. The maximum depth of any tree is at most N, so the
//   outputs that hold a path have D = N slots (static shapes: the ops stay graph-safe).
//   The children of a node are the nodes whose parent it is, taken in increasing index order.
//   Validity of a row (checked on the device, reported per row, never a crash):
//     num_nodes[b] outside [0, N]                                -> kStatusNumNodesOutOfRange (-10)
//     for some i < num_nodes[b]: parents[b, i] < -1 or >= i      -> kStatusInvalidTree (-9)
//     (the order constraint makes cycles and self-parents impossible, so this is the whole check)
//
// ---------------------------------------------------------------------------------------------
// build_tree_mask(parents, num_nodes?, mask!, depth!)
// ---------------------------------------------------------------------------------------------
//   mask  [B, N, N] bool out:  for a used node i: mask[b, i, j] = (j == i or j is an ancestor of i)
//                              (the root is not a node and has no column). For an unused slot i:
//                              mask[b, i, j] = (j == i), so no attention row is ever empty.
//   depth [B, N] int32 out:    depth of node i (>= 1) for a used node, 0 for an unused slot.
//   Invalid row (status s < 0, see above): mask[b] all false and depth[b, :] = s (every entry).
//   So depth[:, 0] < 0 exactly for the invalid rows (a used node 0 has depth 1; the wrapper raises
//   from it). N == 0 is allowed: empty outputs, nothing written (the Python wrapper checks
//   num_nodes == 0 itself in that case).
//
// ---------------------------------------------------------------------------------------------
// tree_verify(target_logits, tree_token_ids, parents, draft_probs?, num_nodes?, temperature?,
//             top_k?, top_p?, seed?, offset?, uniforms?, path!, tokens!, num_accepted!)
// ---------------------------------------------------------------------------------------------
//   target_logits  [B, N+1, V] fp32/bf16/fp16  row 0 scores the children of the root (it is the
//                              target's output at the committed token), row i+1 scores the
//                              children of node i (the output at node i).
//   tree_token_ids [B, N] int64    the token of each node; for i < num_nodes in [0, V).
//   parents        [B, N] int32    the tree (layout above).
//   draft_probs    [B, N, V] fp32, optional: row i is the draft distribution q that node i was
//                              sampled from (the children of one parent were drawn i.i.d. from the
//                              same q, stored on each child). Absent: the children are
//                              deterministic candidates (q one-hot at each child's token).
//   num_nodes      [B] int32, optional (N).
//   temperature, top_k, top_p, seed, offset: [B] as in chain_verify (verifier.h, one check for
//                              both); the target distribution p at a position is the filtered
//                              softmax of sampling_math.h (one-hot argmax below kGreedyTemperature).
//   uniforms       [B, N+1] fp32, optional: column i (< N) is the acceptance draw of node i,
//                              column n = num_nodes[b] the single draw of the recovered/bonus token
//                              (a row's draws do not depend on the buffer's width N). Without it
//                              column c is philox_uniform(seed[b], offset[b] (default 0), c); with
//                              neither, greedy rows run and sampling rows report -11.
//   path           [B, N] int32 out: the accepted node indices from depth 1 down, then -1.
//   tokens         [B, N+1] int64 out: the tokens of the accepted nodes, then the recovered or
//                              bonus token, then -1.
//   num_accepted   [B] int32 out: the accepted depth d (path[b, :d] >= 0, the row emits d + 1
//                              tokens), or a negative RowStatus for an invalid row (path and
//                              tokens then all -1).
//
//   Per row (one TargetDistribution-like state p; u(c) the draw of column c):
//     status checks, in this order, before anything is emitted:
//       validate_filter()                                        (-5, -6, -7)
//       num_nodes in [0, N]                                      (-10)
//       parents[i] in [-1, i) for every i < n                    (-9)
//       draws: a sampling row with neither seed nor uniforms      (-11)
//              u(c) in [0, 1) for every column c in 0..N (all N+1, whatever n is)   (-8)
//       tree_token_ids[i] in [0, V) for every i < n              (-3)
//     walk: cur = -1 (the root), d = 0
//       loop:
//         p <- filtered target at logits row cur+1               (-1 if that row is not finite)
//         for each child c of cur (i < n, parents[i] == cur, increasing i):
//           x = tree_token_ids[c]; q_row = draft_probs ? draft_probs[b, c, :] : one-hot(x)
//           qx = q_row[x]; qx must lie in (0, 1]                 (-2 otherwise: x cannot be drawn at 0)
//           if accept_draft(u(c), p(x), qx):                     (u * qx < p(x), sampling_math.h)
//             path[d] = c; tokens[d] = x; d += 1; cur = c; continue the outer loop
//           p <- normalise(max(0, p - q_row)), p kept where that mass is 0   (-2 if q_row has a
//                                                   NaN, negative or > 1 entry, or its sum strays
//                                                   from 1 by more than kProbabilitySumTolerance; exactly
//                                                   TargetDistribution::subtract)
//         no child accepted (or cur has no children): tokens[d] = sample(p, u(n)) (inverse CDF,
//         sampling_math.h); num_accepted = d; stop.
//   Both lossless rules are this one loop: with draft_probs it is SpecInfer's multi-step
//   speculative sampling (accept w.p. min(1, p/q), residual max(0, p - q)); without, q one-hot
//   makes it "accept x w.p. p(x), else remove x from p and renormalise". On greedy rows p is
//   one-hot, so the walk follows the first child equal to argmax p and emits argmax p.
//   A chain (parents = [-1, 0, 1, ..., N-2]) with the same logits, ids, q, filters and draws gives
//   exactly chain_verify's tokens/num_accepted (num_nodes playing num_draft), and path = [0..d-1].
//   Note: the per-child draw is u(c) for the node index c, not for the depth: a row uses the
//   columns of the children it tries, and column n once.
//
// Notes for a backend (the CPU one is cpu/tree.cpp, one row per task):
//   - The CPU holds p materialised in a [V] scratch row (TargetDistribution: load, prob, subtract,
//     sample). A kernel need not: in the deterministic rule p after rejecting x_1..x_m is the
//     loaded p restricted to the other tokens, renormalised (a few removed ids and a mass); in
//     the q rule w_k(j) = max(0, w_{k-1}(j) / M_{k-1} - q_k(j)), M_k = sum_j w_k(j) (w_0 the
//     filtered exp weights, M_0 their sum; p = w_k / M_k; if M_k is not > 0 the step is skipped:
//     exactly TargetDistribution::subtract), so w_k(j) can be recomputed per element from the
//     logits and the k tried children's q rows, keeping only M_0..M_k. The masses are reductions,
//     so CPU and CUDA may differ in the last bits: compare them exactly only away from decision
//     boundaries (as the chain tests do), and exactly on one-hot/greedy cases.
//   - Every per-row quantity the walk needs is bounded by N (depth <= N, children scanned from
//     current + 1 since parents precede children); no host synchronisation, no dynamic shapes.
//   - build_tree_mask: mask row i = mask row parents[i] | {i}, depth[i] = depth[parents[i]] + 1,
//     sequential in i within a row (or per node: walk the parent links, at most N steps).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include "checks.h"
#include "common/op_views.h"
#include "tensor_data.h"
#include "verifier.h"

namespace specdec {

// An output [B, N, ...] of build_tree_mask beside parents.
inline void check_tree_mask_output(const char* name, const at::Tensor& out, const at::Tensor& parents,
                                   int64_t rank, const char* layout, at::ScalarType dtype) {
  constexpr const char* op = "build_tree_mask";
  check_rank(op, name, out, rank, layout);
  check_size(op, name, out, 0, parents.size(0), "B");
  for (int64_t dim = 1; dim < rank; ++dim) check_size(op, name, out, dim, parents.size(1), "N");
  check_dtype(op, name, out, {dtype});
  check_same_device(op, name, out, parents, "parents");
  check_contiguous(op, name, out);
}

inline void check_build_tree_mask(const at::Tensor& parents,
                                  const c10::optional<at::Tensor>& num_nodes,
                                  const at::Tensor& mask, const at::Tensor& depth) {
  constexpr const char* op = "build_tree_mask";
  check_rank(op, "parents", parents, 2, "[B, N]");
  check_dtype(op, "parents", parents, {at::kInt});
  check_contiguous(op, "parents", parents);
  check_row_param(op, "num_nodes", num_nodes, parents.size(0), at::kInt, parents, "parents");
  check_tree_mask_output("mask", mask, parents, 3, "[B, N, N]", at::kBool);
  check_tree_mask_output("depth", depth, parents, 2, "[B, N]", at::kInt);
}

inline TreeMaskView tree_mask_view(const at::Tensor& parents, const c10::optional<at::Tensor>& num_nodes,
                                   const at::Tensor& mask, const at::Tensor& depth) {
  return {parents.data_ptr<int32_t>(), optional_data<int32_t>(num_nodes), mask.data_ptr<bool>(),
          depth.data_ptr<int32_t>(), parents.size(0), parents.size(1)};
}

struct TreeVerifyArgs {
  VerifierArgs verifier;  // tree_token_ids, num_nodes, ...: the arguments chain_verify has too
  const at::Tensor& parents;
  const at::Tensor& path;
};

inline void check_tree_verify(const TreeVerifyArgs& a) {
  constexpr const char* op = "tree_verify";
  const VerifierNames names{op, "N", "tree_token_ids", "num_nodes"};
  const VerifierShape shape = check_verifier(names, a.verifier);
  const at::Tensor& logits = a.verifier.target_logits;
  check_matrix(op, "parents", a.parents, "[B, N]", shape.batch, "B", shape.drafts,
               "N (target_logits has N+1 positions)", at::kInt, logits, "target_logits");
  check_output(op, "path", a.path, shape.batch, shape.drafts, "N", at::kInt, logits);
  check_outputs_apart(names, a.verifier, &a.path, &a.parents);
}

inline TreeVerifyView tree_verify_view(const TreeVerifyArgs& a) {
  TreeVerifyView v;
  static_cast<VerifierView&>(v) = verifier_view(a.verifier);
  v.parents = a.parents.data_ptr<int32_t>();
  v.path = a.path.data_ptr<int32_t>();
  return v;
}

// build_tree_mask's schema around a backend's implementation, which gets checked, non-empty arguments.
template <void (*Impl)(const at::Tensor&, const c10::optional<at::Tensor>&, at::Tensor&, at::Tensor&)>
void build_tree_mask_op(const at::Tensor& parents, const c10::optional<at::Tensor>& num_nodes, at::Tensor& mask,
                        at::Tensor& depth) {
  check_build_tree_mask(parents, num_nodes, mask, depth);
  if (parents.numel() > 0) Impl(parents, num_nodes, mask, depth);
}

// tree_verify's schema around a backend's implementation, which gets checked arguments, B > 0.
template <void (*Impl)(const TreeVerifyArgs&)>
void tree_verify_op(const at::Tensor& target_logits, const at::Tensor& tree_token_ids, const at::Tensor& parents,
                    const c10::optional<at::Tensor>& draft_probs, const c10::optional<at::Tensor>& num_nodes,
                    const c10::optional<at::Tensor>& temperature, const c10::optional<at::Tensor>& top_k,
                    const c10::optional<at::Tensor>& top_p, const c10::optional<at::Tensor>& seed,
                    const c10::optional<at::Tensor>& offset, const c10::optional<at::Tensor>& uniforms,
                    at::Tensor& path, at::Tensor& tokens, at::Tensor& num_accepted) {
  const TreeVerifyArgs args{{target_logits, tree_token_ids, draft_probs, num_nodes,
                             {temperature, top_k, top_p, seed, offset, uniforms}, tokens, num_accepted},
                            parents,
                            path};
  check_tree_verify(args);
  if (target_logits.size(0) > 0) Impl(args);
}

// Registers a backend's implementations of the family's ops under their schemas.
template <void (*BuildTreeMask)(const at::Tensor&, const c10::optional<at::Tensor>&, at::Tensor&, at::Tensor&),
          void (*TreeVerify)(const TreeVerifyArgs&)>
void register_tree_ops(torch::Library& m) {
  m.impl("build_tree_mask", &build_tree_mask_op<BuildTreeMask>);
  m.impl("tree_verify", &tree_verify_op<TreeVerify>);
}

}  // namespace specdec
