// Hand-computed expectations for the CPU tree kernels (csrc/tree.h), called through the dispatcher
// as the Python wrappers do. The target at every position is p = [0.1, 0.2, 0.3, 0.4] (logits
// log(p) at T = 1), so every expected path and token can be checked with pencil and paper.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <optional>
#include <vector>

#include "op_call.h"

namespace {

using specdec_test::OptTensor;

void build_tree_mask_op(const at::Tensor& parents, const OptTensor& num_nodes, at::Tensor& mask,
                        at::Tensor& depth) {
  specdec_test::build_tree_mask(parents, num_nodes, mask, depth);
}

void tree_verify_op(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& parents,
                    const OptTensor& draft_probs, const OptTensor& num_nodes, const OptTensor& temperature,
                    const OptTensor& top_k, const OptTensor& top_p, const OptTensor& seed,
                    const OptTensor& offset, const OptTensor& uniforms, at::Tensor& path,
                    at::Tensor& tokens, at::Tensor& num_accepted) {
  specdec_test::tree_verify(logits, ids, parents, draft_probs, num_nodes, temperature, top_k, top_p, seed, offset,
                            uniforms, path, tokens, num_accepted);
}

void chain_verify_op(const at::Tensor& logits, const at::Tensor& draft, const OptTensor& draft_probs,
                     const OptTensor& num_draft, const OptTensor& seed, at::Tensor& tokens,
                     at::Tensor& num_accepted) {
  specdec_test::chain_verify(logits, draft, draft_probs, num_draft, std::nullopt, std::nullopt, std::nullopt, seed,
                             std::nullopt, std::nullopt, tokens, num_accepted);
}

template <typename T>
std::vector<T> to_vector(const at::Tensor& t) {
  auto c = t.contiguous();
  return std::vector<T>(c.data_ptr<T>(), c.data_ptr<T>() + c.numel());
}

at::Tensor parents_tensor(std::vector<int32_t> parents) {
  return torch::tensor(parents, torch::kInt).view({1, static_cast<int64_t>(parents.size())});
}

at::Tensor p_logits(int64_t positions) {  // [1, positions, 4], p = [0.1, 0.2, 0.3, 0.4] everywhere
  auto logits = torch::tensor({std::log(0.1f), std::log(0.2f), std::log(0.3f), std::log(0.4f)});
  return logits.repeat({1, positions, 1});
}

struct TreeResult {
  std::vector<int32_t> path;
  std::vector<int64_t> tokens;
  int32_t num_accepted;
};

TreeResult verify(std::vector<int32_t> parents, std::vector<int64_t> ids, std::vector<float> uniforms,
                  OptTensor draft_probs = std::nullopt, OptTensor temperature = std::nullopt,
                  OptTensor num_nodes = std::nullopt) {
  const int64_t n = static_cast<int64_t>(parents.size());
  auto path = torch::empty({1, n}, torch::kInt);
  auto tokens = torch::empty({1, n + 1}, torch::kLong);
  auto num_accepted = torch::empty({1}, torch::kInt);
  tree_verify_op(p_logits(n + 1), torch::tensor(ids, torch::kLong).view({1, n}), parents_tensor(parents),
                 draft_probs, num_nodes, temperature, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                 torch::tensor(uniforms).view({1, n + 1}), path, tokens, num_accepted);
  return {to_vector<int32_t>(path), to_vector<int64_t>(tokens), num_accepted.item<int32_t>()};
}

TEST(BuildTreeMask, HandExample) {
  //        root
  //       /    \
  //      0      1
  //     / \      \
  //    2   3      4
  //    |
  //    5
  auto parents = parents_tensor({-1, -1, 0, 0, 1, 2});
  auto mask = torch::empty({1, 6, 6}, torch::kBool);
  auto depth = torch::empty({1, 6}, torch::kInt);
  build_tree_mask_op(parents, std::nullopt, mask, depth);
  EXPECT_EQ(to_vector<int32_t>(depth), (std::vector<int32_t>{1, 1, 2, 2, 2, 3}));
  const std::vector<int32_t> expected = {1, 0, 0, 0, 0, 0,  //
                                         0, 1, 0, 0, 0, 0,  //
                                         1, 0, 1, 0, 0, 0,  //
                                         1, 0, 0, 1, 0, 0,  //
                                         0, 1, 0, 0, 1, 0,  //
                                         1, 0, 1, 0, 0, 1};
  EXPECT_EQ(to_vector<int32_t>(mask.to(torch::kInt)), expected);
}

TEST(BuildTreeMask, UnusedSlotsAndInvalidRows) {
  // row 0: 2 used nodes, the unused slots (with garbage parents) see only themselves, depth 0;
  // row 1: node 1's parent is itself -> invalid tree (-9); row 2: num_nodes 4 > N -> -10.
  auto parents = torch::tensor({-1, 0, 7, -5, -1, 1, 0, 0, -1, 0, 0, 0}, torch::kInt).view({3, 4});
  auto num_nodes = torch::tensor({2, 4, 5}, torch::kInt);
  auto mask = torch::empty({3, 4, 4}, torch::kBool);
  auto depth = torch::empty({3, 4}, torch::kInt);
  build_tree_mask_op(parents, num_nodes, mask, depth);
  EXPECT_EQ(to_vector<int32_t>(depth),
            (std::vector<int32_t>{1, 2, 0, 0, -9, -9, -9, -9, -10, -10, -10, -10}));
  EXPECT_EQ(to_vector<int32_t>(mask[0].to(torch::kInt)),
            (std::vector<int32_t>{1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1}));
  EXPECT_FALSE(mask[1].any().item<bool>());
  EXPECT_FALSE(mask[2].any().item<bool>());
}

TEST(BuildTreeMask, BadArgumentsThrow) {
  auto mask = torch::empty({1, 3, 3}, torch::kBool);
  auto depth = torch::empty({1, 3}, torch::kInt);
  EXPECT_THROW(build_tree_mask_op(torch::full({1, 3}, -1, torch::kLong), std::nullopt, mask, depth), c10::Error);
  auto small_mask = torch::empty({1, 3, 2}, torch::kBool);
  EXPECT_THROW(build_tree_mask_op(parents_tensor({-1, 0, 0}), std::nullopt, small_mask, depth), c10::Error);
}

TEST(TreeVerify, DeterministicSecondChildAcceptedAfterFirstRemoved) {
  // Root children: node 0 (token 3, p = 0.4), node 1 (token 2). u0 = 0.5 >= 0.4 rejects token 3,
  // p becomes [1/6, 2/6, 3/6, 0]; u1 = 0.4 < p(2) = 0.5 accepts node 1, a leaf: the bonus from
  // row 2 with u = 0.05 is token 0 (running sum 0.1 > 0.05).
  const auto r = verify({-1, -1}, {3, 2}, {0.5f, 0.4f, 0.05f});
  EXPECT_EQ(r.num_accepted, 1);
  EXPECT_EQ(r.path, (std::vector<int32_t>{1, -1}));
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{2, 0, -1}));
}

TEST(TreeVerify, DeterministicAllChildrenRejected) {
  // As above but u1 = 0.6 >= 0.5 rejects token 2 too: p = [1/3, 2/3, 0, 0]; u = 0.5 -> token 1.
  const auto r = verify({-1, -1}, {3, 2}, {0.5f, 0.6f, 0.5f});
  EXPECT_EQ(r.num_accepted, 0);
  EXPECT_EQ(r.path, (std::vector<int32_t>{-1, -1}));
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{1, -1, -1}));
}

TEST(TreeVerify, StochasticSiblingsApplyTheResidualTwice) {
  // Both root children drew token 0 from q = [0.4, 0.3, 0.2, 0.1]. Node 0: u0 * 0.4 = 0.12 >= 0.1
  // rejects; p <- max(0, p - q) / 0.4 = [0, 0, 0.25, 0.75]. Node 1: p(0) = 0 rejects;
  // p <- max(0, p - q) / 0.7 = [0, 0, 1/14, 13/14]. u = 0.1 > 1/14 -> token 3 (one residual only
  // would give token 2).
  auto q = torch::tensor({0.4f, 0.3f, 0.2f, 0.1f}).repeat({1, 2, 1});
  auto r = verify({-1, -1}, {0, 0}, {0.3f, 0.0f, 0.1f}, q);
  EXPECT_EQ(r.num_accepted, 0);
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{3, -1, -1}));
  r = verify({-1, -1}, {0, 0}, {0.3f, 0.0f, 0.05f}, q);  // 0.05 < 1/14 -> token 2
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{2, -1, -1}));
  // u0 = 0.2: 0.08 < 0.1 accepts node 0 (a leaf); the bonus from row 1 with u = 0.95 is token 3.
  r = verify({-1, -1}, {0, 0}, {0.2f, 0.0f, 0.95f}, q);
  EXPECT_EQ(r.num_accepted, 1);
  EXPECT_EQ(r.path, (std::vector<int32_t>{0, -1}));
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{0, 3, -1}));
}

TEST(TreeVerify, TwoLevelsDeterministic) {
  // Node 0 (token 3) under the root; nodes 1 (token 1) and 2 (token 2) under node 0.
  // u0 = 0.35 < 0.4 accepts node 0. At node 0: u1 = 0.5 >= 0.2 rejects token 1, p = [1/8, 0, 3/8, 4/8];
  // u2 = 0.3 < 3/8 accepts node 2, a leaf: the bonus from row 3 with u = 0.65 is token 3.
  const auto r = verify({-1, 0, 0}, {3, 1, 2}, {0.35f, 0.5f, 0.3f, 0.65f});
  EXPECT_EQ(r.num_accepted, 2);
  EXPECT_EQ(r.path, (std::vector<int32_t>{0, 2, -1}));
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{3, 2, 3, -1}));
}

TEST(TreeVerify, GreedyFollowsArgmax) {
  // argmax p = 3 everywhere: node 0 (token 2) rejected, node 1 (token 3) accepted, then its child
  // node 3 (token 3) accepted; node 3 is a leaf, the bonus is argmax 3. The draws do not matter.
  const auto r = verify({-1, -1, 0, 1}, {2, 3, 1, 3}, {0.99f, 0.99f, 0.99f, 0.99f, 0.99f}, std::nullopt,
                        torch::zeros({1}));
  EXPECT_EQ(r.num_accepted, 2);
  EXPECT_EQ(r.path, (std::vector<int32_t>{1, 3, -1, -1}));
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{3, 3, 3, -1, -1}));
}

TEST(TreeVerify, InvalidRowsReportStatus) {
  auto r = verify({-1, 1}, {0, 0}, {0.5f, 0.5f, 0.5f});  // node 1 is its own parent
  EXPECT_EQ(r.num_accepted, -9);
  EXPECT_EQ(r.path, (std::vector<int32_t>{-1, -1}));
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{-1, -1, -1}));
  r = verify({-1, 0}, {0, 0}, {0.5f, 0.5f, 0.5f}, std::nullopt, std::nullopt, torch::tensor({3}, torch::kInt));
  EXPECT_EQ(r.num_accepted, -10);
  r = verify({-1, 0}, {0, 4}, {0.5f, 0.5f, 0.5f});  // token 4 outside V = 4
  EXPECT_EQ(r.num_accepted, -3);
  // num_nodes = 1: node 1's bad token is never read; node 0 (token 3) accepted, bonus u = 0.5 -> 2
  r = verify({-1, 0}, {3, 4}, {0.1f, 0.5f, 0.5f}, std::nullopt, std::nullopt, torch::tensor({1}, torch::kInt));
  EXPECT_EQ(r.num_accepted, 1);
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{3, 2, -1}));
}

TEST(TreeVerify, MismatchedNodeCountThrows) {
  auto path = torch::empty({1, 2}, torch::kInt);
  auto tokens = torch::empty({1, 3}, torch::kLong);
  auto num_accepted = torch::empty({1}, torch::kInt);
  EXPECT_THROW(tree_verify_op(p_logits(3), torch::zeros({1, 2}, torch::kLong), parents_tensor({-1, 0, 1}),
                              std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt,
                              torch::zeros({1}, torch::kLong), std::nullopt, std::nullopt, path, tokens,
                              num_accepted),
               c10::Error);
}

TEST(TreeVerify, ChainTreeEqualsChainVerify) {
  torch::manual_seed(0);
  const int64_t batch = 32, k = 5, vocab = 16;
  auto logits = torch::randn({batch, k + 1, vocab}) * 2;
  auto draft = std::get<1>(logits.slice(1, 0, k).max(-1));  // greedy-ish drafts: often accepted
  draft.index_put_({torch::rand({batch, k}) < 0.3}, 5);
  auto q = torch::softmax(torch::randn({batch, k, vocab}), -1);
  auto parents = torch::arange(-1, k - 1, torch::kInt).repeat({batch, 1});
  auto num = torch::randint(0, k + 1, {batch}, torch::kInt);
  auto seed = torch::arange(batch, torch::kLong);
  for (const OptTensor& probs : {OptTensor(q), OptTensor()}) {
    auto path = torch::empty({batch, k}, torch::kInt);
    auto tokens = torch::empty({batch, k + 1}, torch::kLong);
    auto n = torch::empty({batch}, torch::kInt);
    tree_verify_op(logits, draft, parents, probs, num, std::nullopt, std::nullopt, std::nullopt, seed,
                   std::nullopt, std::nullopt, path, tokens, n);
    auto chain_tokens = torch::empty({batch, k + 1}, torch::kLong);
    auto chain_n = torch::empty({batch}, torch::kInt);
    chain_verify_op(logits, draft, probs, num, seed, chain_tokens, chain_n);
    EXPECT_TRUE(torch::equal(tokens, chain_tokens));
    EXPECT_TRUE(torch::equal(n, chain_n));
    EXPECT_GT(n.gt(0).sum().item<int64_t>(), 0);
  }
}

}  // namespace
