// Hand-computed expectations for the CPU sampling kernels. Target p = [0.1, 0.2, 0.3, 0.4] comes
// from logits log(p) at T = 1, so every expected token can be checked with pencil and paper.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/philox.h"
#include "op_call.h"

namespace {

using specdec_test::OptTensor;

at::Tensor row_logits(int positions) {
  auto logits = torch::tensor({std::log(0.1f), std::log(0.2f), std::log(0.3f), std::log(0.4f)});
  return logits.repeat({1, positions, 1});  // [1, positions, 4]
}

struct Result {
  std::vector<int64_t> tokens;
  int32_t num_accepted;
};

Result verify(const at::Tensor& logits, std::vector<int64_t> draft, std::vector<float> uniforms,
              OptTensor draft_probs = std::nullopt, OptTensor temperature = std::nullopt,
              OptTensor top_k = std::nullopt, OptTensor top_p = std::nullopt) {
  const int64_t k = static_cast<int64_t>(draft.size());
  auto tokens = torch::empty({1, k + 1}, torch::kLong);
  auto num_accepted = torch::empty({1}, torch::kInt);
  specdec_test::chain_verify(logits, torch::tensor(draft).view({1, k}), draft_probs, std::nullopt, temperature,
                             top_k, top_p, std::nullopt, std::nullopt, torch::tensor(uniforms).view({1, k + 1}),
                             tokens, num_accepted);
  auto t = tokens.contiguous();
  return {std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + k + 1),
          num_accepted.item<int32_t>()};
}

TEST(Philox, KnownAnswerCounterZeroKeyZero) {
  // Random123 known-answer vector for philox4x32-10 with counter 0 and key 0.
  const auto out = specdec::philox4x32_10({{0u, 0u, 0u, 0u}}, 0u, 0u);
  EXPECT_EQ(out.v[0], 0x6627e8d5u);
  EXPECT_EQ(out.v[1], 0xe169c58du);
  EXPECT_EQ(out.v[2], 0xbc57ac4cu);
  EXPECT_EQ(out.v[3], 0x9b00dbd8u);
}

TEST(Philox, KnownAnswerAllOnes) {
  const auto out = specdec::philox4x32_10({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}},
                                          0xffffffffu, 0xffffffffu);
  EXPECT_EQ(out.v[0], 0x408f276du);
  EXPECT_EQ(out.v[1], 0x41c83b0eu);
  EXPECT_EQ(out.v[2], 0xa20bc7c6u);
  EXPECT_EQ(out.v[3], 0x6d5451fdu);
}

TEST(ChainVerify, DeterministicDraftAcceptedThenBonus) {
  // u0 = 0.35 < p(3) = 0.4: accept; bonus with u = 0.05: running sum 0.1 > 0.05 -> token 0.
  const auto r = verify(row_logits(2), {3}, {0.35f, 0.05f});
  EXPECT_EQ(r.num_accepted, 1);
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{3, 0}));
}

TEST(ChainVerify, DeterministicDraftRejectedSamplesWithoutTheDraft) {
  // u0 = 0.5 >= 0.4: reject; the residual of a one-hot q is p without token 3: [1/6, 2/6, 3/6, 0].
  // u = 0.2: running sums 1/6 < 0.2, 3/6 > 0.2 -> token 1; trailing slot empty.
  const auto r = verify(row_logits(3), {3, 2}, {0.5f, 0.0f, 0.2f});
  EXPECT_EQ(r.num_accepted, 0);
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{1, -1, -1}));
}

TEST(ChainVerify, StochasticDraftRejectedSamplesTheResidual) {
  // q = [0.4, 0.3, 0.2, 0.1], draft 0: accept iff u * 0.4 < 0.1, so u = 0.3 rejects.
  // residual max(0, p - q) = [0, 0, 0.1, 0.3] -> [0, 0, 0.25, 0.75]; u = 0.3 -> token 3.
  auto q = torch::tensor({0.4f, 0.3f, 0.2f, 0.1f}).view({1, 1, 4});
  auto r = verify(row_logits(2), {0}, {0.3f, 0.3f}, q);
  EXPECT_EQ(r.num_accepted, 0);
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{3, -1}));
  // u = 0.2 accepts (0.08 < 0.1); the bonus with u = 0.95 is the last token.
  r = verify(row_logits(2), {0}, {0.2f, 0.95f}, q);
  EXPECT_EQ(r.num_accepted, 1);
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{0, 3}));
}

TEST(ChainVerify, GreedyFollowsArgmax) {
  auto zero = torch::zeros({1});
  auto r = verify(row_logits(3), {3, 3}, {0.99f, 0.99f, 0.99f}, std::nullopt, zero);
  EXPECT_EQ(r.num_accepted, 2);
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{3, 3, 3}));
  r = verify(row_logits(3), {3, 1}, {0.0f, 0.0f, 0.0f}, std::nullopt, zero);
  EXPECT_EQ(r.num_accepted, 1);
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{3, 3, -1}));
}

TEST(ChainVerify, TopKAndTopPKeepTheTwoLikeliest) {
  // top-k = 2 keeps {2, 3}: p = [0, 0, 3/7, 4/7]. top-p = 0.5 keeps 0.4 (0.4 < 0.5) and 0.3
  // (0.7 >= 0.5): the same set. With u = 0.4: 3/7 = 0.43 > 0.4 -> token 2; u = 0.5 -> token 3.
  const auto top_k = torch::full({1}, 2, torch::kInt);
  const auto top_p = torch::full({1}, 0.5f);
  for (const auto& [k_param, p_param] : {std::pair<OptTensor, OptTensor>{top_k, std::nullopt},
                                         std::pair<OptTensor, OptTensor>{std::nullopt, top_p}}) {
    EXPECT_EQ(verify(row_logits(1), {}, {0.4f}, std::nullopt, std::nullopt, k_param, p_param).tokens,
              (std::vector<int64_t>{2}));
    EXPECT_EQ(verify(row_logits(1), {}, {0.5f}, std::nullopt, std::nullopt, k_param, p_param).tokens,
              (std::vector<int64_t>{3}));
  }
  // A draft outside the kept set has p = 0 and is always rejected.
  const auto r = verify(row_logits(2), {0}, {0.0f, 0.0f}, std::nullopt, std::nullopt, top_k);
  EXPECT_EQ(r.num_accepted, 0);
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{2, -1}));
}

TEST(ChainVerify, InvalidRowsGetAStatusAndEmptyTokens) {
  auto logits = row_logits(2);
  logits.index_put_({0, 0, 1}, NAN);
  auto r = verify(logits, {3}, {0.1f, 0.1f});
  EXPECT_EQ(r.num_accepted, -1);  // kStatusNonFiniteLogits
  EXPECT_EQ(r.tokens, (std::vector<int64_t>{-1, -1}));
  r = verify(row_logits(2), {4}, {0.1f, 0.1f});
  EXPECT_EQ(r.num_accepted, -3);  // kStatusDraftTokenOutOfRange
  r = verify(row_logits(2), {0}, {1.0f, 0.1f});
  EXPECT_EQ(r.num_accepted, -8);  // kStatusInvalidUniform
}

TEST(ChainVerify, ShapeErrorsNameTheArgument) {
  auto tokens = torch::empty({1, 2}, torch::kLong);
  auto num_accepted = torch::empty({1}, torch::kInt);
  try {
    specdec_test::chain_verify(row_logits(2), torch::zeros({1, 2}, torch::kLong), std::nullopt, std::nullopt,
                               std::nullopt, std::nullopt, std::nullopt, torch::zeros({1}, torch::kLong),
                               std::nullopt, std::nullopt, tokens, num_accepted);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("draft_token_ids dimension 1 must be k"), std::string::npos);
  }
}

TEST(ResidualProbs, HandComputed) {
  auto p = torch::tensor({0.1f, 0.2f, 0.3f, 0.4f});
  auto q = torch::tensor({0.4f, 0.3f, 0.2f, 0.1f});
  auto out = torch::empty({4});
  specdec_test::residual_probs(p, q, out);
  EXPECT_TRUE(torch::allclose(out, torch::tensor({0.0f, 0.0f, 0.25f, 0.75f})));
  specdec_test::residual_probs(p, p, out);  // zero residual mass: p itself
  EXPECT_TRUE(torch::equal(out, p));
}

}  // namespace
