// chain_verify's two kernels and tree_verify's kernel under the emulator against the CPU ops, over
// fp32/fp16/bf16, V in {1, 7, 32000, 151936}, with and without draft probabilities, random
// temperatures (greedy, 1e-39, finite, 1e30, inf), top-k and top-p per row, explicit uniforms and
// Philox seeds, ragged draft counts and random trees (verifier_cases.h says how rows are compared).
#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <tuple>

#include "verifier_cases.h"

namespace specdec_test {
namespace {

struct Shape {
  int64_t batch, drafts, cases;
};

Shape shape_for(int64_t vocab) {
  if (vocab >= 100000) return {4, 4, 3};
  if (vocab >= 10000) return {4, 5, 3};
  return {8, 8, 8};
}

using Params = std::tuple<bool /*tree*/, at::ScalarType, int64_t /*vocab*/, bool /*draft_probs*/>;

class EmulatedVerifier : public ::testing::TestWithParam<Params> {};

TEST_P(EmulatedVerifier, MatchesTheCpuOp) {
  const auto [tree, dtype, vocab, draft_probs] = GetParam();
  const Shape shape = shape_for(vocab);
  Comparison total;
  for (int64_t c = 0; c < shape.cases; ++c) {
    CaseOptions options;
    options.tree = tree;
    options.dtype = dtype;
    options.vocab = vocab;
    options.batch = shape.batch;
    options.drafts = shape.drafts;
    options.draft_probs = draft_probs;
    options.explicit_uniforms = c % 2 == 0;
    options.sampling_filters = c % 3 != 2;
    options.seed = 1000 * static_cast<uint64_t>(vocab) + 17 * c + (tree ? 7 : 0) + (draft_probs ? 3 : 0);
    const VerifierInputs in = make_case(options);
    std::string error;
    const VerifierOutputs emulated = run_emulated(in, error);
    ASSERT_EQ(error, "") << "emulator error in case " << c;
    total.add(compare(in, run_cpu(in), emulated));
  }
  std::cout << "[ emulated ] " << total.summary() << std::endl;
  for (const std::string& row : total.boundary_rows) std::cout << "[ boundary ] " << row << std::endl;
  for (const std::string& failure : total.failures) ADD_FAILURE() << failure;
  // A mismatch is excused only near a boundary, and such draws are rare: a wrong kernel would pile
  // them up. Past V = 1 / kMarginTolerance (50000) a sampled token's own bin of the inverse CDF is about
  // as narrow as the tolerance (a flat distribution over 151936 tokens: bins of 6.6e-6), so nearly every
  // sampled token lies that near a boundary and the two sums' rounding decides more of them (measured:
  // 2 of 12 rows at V = 151936 in fp32 once the draws moved to column num_draft, each one token apart,
  // margins 1e-8 and 9e-7).
  const int64_t excusable = vocab * kMarginTolerance > 1.0 ? total.rows / 4 : total.rows / 50;
  EXPECT_LE(total.boundary_mismatches, 1 + excusable) << total.summary();
}

std::string name(const ::testing::TestParamInfo<Params>& info) {
  const auto [tree, dtype, vocab, draft_probs] = info.param;
  return std::string(tree ? "Tree" : "Chain") + "_" + c10::toString(dtype) + "_V" + std::to_string(vocab) +
         (draft_probs ? "_DraftProbs" : "_Deterministic");
}

INSTANTIATE_TEST_SUITE_P(Kernels, EmulatedVerifier,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(at::kFloat, at::kHalf, at::kBFloat16),
                                            ::testing::Values(int64_t{1}, int64_t{7}, int64_t{32000},
                                                              int64_t{151936}),
                                            ::testing::Bool()),
                         name);

}  // namespace
}  // namespace specdec_test
