// Exact cases under the emulator and on the CPU alike: every RowStatus code of both verifiers,
// and the temperature edge cases of csrc/common/sampling_math.h (greedy below 1e-5, T = inf uniform
// over the finite logits, T = 1e30, no draws needed by greedy rows).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/sampling_math.h"
#include "verifier_cases.h"

namespace specdec_test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Runs both backends; they must agree exactly; returns the CPU's outputs.
VerifierOutputs run_both(const VerifierInputs& in) {
  std::string error;
  const VerifierOutputs emulated = run_emulated(in, error);
  EXPECT_EQ(error, "");
  const VerifierOutputs cpu = run_cpu(in);
  EXPECT_TRUE(torch::equal(cpu.num_accepted, emulated.num_accepted))
      << "cpu " << cpu.num_accepted << " emulated " << emulated.num_accepted;
  EXPECT_TRUE(torch::equal(cpu.tokens, emulated.tokens)) << "cpu " << cpu.tokens << " emulated " << emulated.tokens;
  if (in.parents) EXPECT_TRUE(torch::equal(cpu.path, emulated.path)) << "cpu " << cpu.path << " emulated " << emulated.path;
  return cpu;
}

std::vector<int64_t> tokens_of(const VerifierOutputs& out, int64_t row = 0) {
  const at::Tensor t = out.tokens[row].contiguous();
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

VerifierInputs one_row(std::vector<std::vector<float>> logits, std::vector<int64_t> ids, bool tree) {
  VerifierInputs in;
  const int64_t positions = static_cast<int64_t>(logits.size()), vocab = static_cast<int64_t>(logits[0].size());
  std::vector<float> flat;
  for (const auto& row : logits) flat.insert(flat.end(), row.begin(), row.end());
  in.logits = torch::tensor(flat).view({1, positions, vocab});
  in.ids = torch::tensor(ids, torch::kLong).view({1, positions - 1});
  if (tree) in.parents = torch::arange(-1, positions - 2, torch::kInt).view({1, positions - 1});
  return in;
}

// ------------------------------------------------------------------------------------------------
// Status codes

struct StatusCase {
  const char* name;
  int32_t status;
  bool chain, tree;  // which verifiers have it
  std::function<void(VerifierInputs&)> corrupt;
};

const std::vector<StatusCase>& status_cases() {
  static const std::vector<StatusCase> cases = {
      {"NaN logit", specdec::kStatusNonFiniteLogits, true, true,
       [](VerifierInputs& in) { in.logits.index_put_({0, 0, 2}, NAN); }},
      {"every logit -inf", specdec::kStatusNonFiniteLogits, true, true,
       [](VerifierInputs& in) { in.logits[0][0].fill_(-kInf); }},
      {"+inf logit", specdec::kStatusNonFiniteLogits, true, true,
       [](VerifierInputs& in) { in.logits.index_put_({0, 0, 1}, kInf); }},
      {"negative draft probability", specdec::kStatusInvalidDraftProbs, true, true,
       [](VerifierInputs& in) { in.draft_probs = torch::full({1, 3, 7}, -0.2f); }},
      {"NaN draft probability", specdec::kStatusInvalidDraftProbs, true, true,
       [](VerifierInputs& in) { in.draft_probs = torch::full({1, 3, 7}, NAN); }},
      {"token id out of range", specdec::kStatusDraftTokenOutOfRange, true, true,
       [](VerifierInputs& in) { in.ids.index_put_({0, 2}, 7); }},
      {"negative token id", specdec::kStatusDraftTokenOutOfRange, true, true,
       [](VerifierInputs& in) { in.ids.index_put_({0, 0}, -1); }},
      {"num_draft above k", specdec::kStatusNumDraftOutOfRange, true, false,
       [](VerifierInputs& in) { in.counts = torch::full({1}, 4, torch::kInt); }},
      {"negative temperature", specdec::kStatusInvalidTemperature, true, true,
       [](VerifierInputs& in) { in.temperature = torch::full({1}, -1.0f); }},
      {"NaN temperature", specdec::kStatusInvalidTemperature, true, true,
       [](VerifierInputs& in) { in.temperature = torch::full({1}, NAN); }},
      {"negative top_k", specdec::kStatusInvalidTopK, true, true,
       [](VerifierInputs& in) { in.top_k = torch::full({1}, -1, torch::kInt); }},
      {"top_p 0", specdec::kStatusInvalidTopP, true, true, [](VerifierInputs& in) { in.top_p = torch::zeros({1}); }},
      {"top_p above 1", specdec::kStatusInvalidTopP, true, true,
       [](VerifierInputs& in) { in.top_p = torch::full({1}, 1.5f); }},
      {"uniform 1", specdec::kStatusInvalidUniform, true, true,
       [](VerifierInputs& in) { in.uniforms->index_put_({0, 3}, 1.0f); }},
      {"a parent after its node", specdec::kStatusInvalidTree, false, true,
       [](VerifierInputs& in) { in.parents->index_put_({0, 1}, 2); }},
      {"num_nodes above N", specdec::kStatusNumNodesOutOfRange, false, true,
       [](VerifierInputs& in) { in.counts = torch::full({1}, 4, torch::kInt); }},
      {"no seed and no uniforms at T > 0", specdec::kStatusMissingRandomness, true, true,
       [](VerifierInputs& in) { in.uniforms.reset(); }},
  };
  return cases;
}

TEST(EmulatedStatus, EveryCodeOfBothVerifiers) {
  for (const bool tree : {false, true}) {
    for (const StatusCase& c : status_cases()) {
      if (!(tree ? c.tree : c.chain)) continue;
      SCOPED_TRACE(std::string(tree ? "tree: " : "chain: ") + c.name);
      VerifierInputs in = one_row({{0, 1, 2, 3, 2, 1, 0}, {3, 2, 1, 0, 1, 2, 3}, {0, 0, 1, 1, 0, 0, 1}, {1, 2, 3, 4, 5, 6, 7}},
                                  {3, 0, 2}, tree);
      in.uniforms = torch::full({1, 4}, 0.5f);
      c.corrupt(in);
      const VerifierOutputs out = run_both(in);
      EXPECT_EQ(out.num_accepted[0].item<int32_t>(), c.status);
      EXPECT_EQ(tokens_of(out), std::vector<int64_t>(4, -1));
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Greedy rows: the lowest index among tied maxima, wherever they lie

TEST(EmulatedGreedy, TiedMaximaFarApartTakeTheLowestIndex) {
  // Maxima 8192 apart land in different spans of one thread's strided loop, or in different
  // statistics chunks; 4097 apart in different threads of one span.
  for (const bool tree : {false, true}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      for (const int64_t vocab : {32000, 151936}) {
        SCOPED_TRACE(std::string(tree ? "tree " : "chain ") + c10::toString(dtype) + " V=" + std::to_string(vocab));
        VerifierInputs in;
        at::Tensor logits = torch::randn({3, 2, vocab}, at::make_generator<at::CPUGeneratorImpl>(vocab));
        const std::vector<std::vector<int64_t>> maxima = {{5, 5 + 8192, 5 + 2 * 8192}, {300, 300 + 4097}, {9000, 17192}};
        for (int64_t b = 0; b < 3; ++b) {
          for (const int64_t j : maxima[b]) logits.index_put_({b, torch::indexing::Slice(), j}, 50.0f);
        }
        in.logits = logits.to(dtype);
        in.ids = torch::tensor({maxima[0][1], maxima[1][0], maxima[2][1]}).view({3, 1});  // drafts: rejected, accepted, rejected
        if (tree) in.parents = torch::full({3, 1}, -1, torch::kInt);
        in.temperature = torch::zeros({3});
        const VerifierOutputs out = run_both(in);
        EXPECT_EQ(tokens_of(out, 0), (std::vector<int64_t>{maxima[0][0], -1}));
        EXPECT_EQ(tokens_of(out, 1), (std::vector<int64_t>{maxima[1][0], maxima[1][0]}));
        EXPECT_EQ(tokens_of(out, 2), (std::vector<int64_t>{maxima[2][0], -1}));
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Temperatures

TEST(EmulatedTemperature, TinyTemperatureIsGreedy) {
  // The reported case: T = 1e-39 used to give NaN weights and reject the argmax draft.
  for (const bool tree : {false, true}) {
    for (const float t : {1e-39f, 0.0f, 3e-39f, 9.9e-6f}) {
      VerifierInputs in = one_row({{0, 5, 1}, {0, 1, 7}}, {1}, tree);
      in.temperature = torch::full({1}, t);
      in.seed = torch::zeros({1}, torch::kLong);
      EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{1, 2})) << "T=" << t;
    }
  }
}

TEST(EmulatedTemperature, GreedyRowsNeedNoDraws) {
  for (const bool tree : {false, true}) {
    VerifierInputs in = one_row({{0, 5, 1}, {0, 1, 7}}, {1}, tree);
    in.temperature = torch::zeros({1});
    EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{1, 2}));
    in.ids.fill_(0);  // the draft is not the argmax: rejected, the argmax emitted
    EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{1, -1}));
  }
}

TEST(EmulatedTemperature, TheGreedyThresholdSeparatesTiesFromArgmax) {
  // Two tied logits: greedy takes the lower index whatever the draw; just above the threshold the
  // weights are equal and a draw of 0.9 takes the upper one.
  for (const bool tree : {false, true}) {
    VerifierInputs in = one_row({{0, 0}}, {}, tree);
    in.uniforms = torch::full({1, 1}, 0.9f);
    in.temperature = torch::full({1}, specdec::kGreedyTemperature * 0.99f);
    EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{0}));
    in.temperature = torch::full({1}, specdec::kGreedyTemperature);
    EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{1}));
  }
}

TEST(EmulatedTemperature, InfiniteTemperatureIsUniformOverTheFiniteLogits) {
  for (const bool tree : {false, true}) {
    for (const float t : {kInf, 1e30f}) {
      SCOPED_TRACE(t);
      VerifierInputs in = one_row({{0, 5, -kInf}}, {}, tree);
      in.temperature = torch::full({1}, t);
      for (const auto& [u, token] : std::vector<std::pair<float, int64_t>>{{0.1f, 0}, {0.49f, 0}, {0.51f, 1}, {0.999f, 1}}) {
        in.uniforms = torch::full({1, 1}, u);
        EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{token})) << "u=" << u;
      }
      // top-k and top-p follow the logits' order: top-k 1 keeps the largest; top-p 0.5 of three
      // equal weights keeps the two largest logits (5 and 3).
      in = one_row({{0, 5, 3, -kInf}}, {}, tree);
      in.temperature = torch::full({1}, t);
      in.uniforms = torch::full({1, 1}, 0.2f);
      in.top_k = torch::ones({1}, torch::kInt);
      EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{1}));
      in.top_k.reset();
      in.top_p = torch::full({1}, 0.5f);
      EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{1}));
      in.uniforms = torch::full({1, 1}, 0.7f);
      EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{2}));
    }
  }
}

TEST(EmulatedTemperature, InfiniteTemperatureWeighsLogitsFurtherApartThanFloatSpans) {
  // 3e38 - (-3e38) overflows to -inf, and -inf * (1 / T = 0) was NaN: the far logit weighed 0 where every
  // finite logit weighs 1 at T = inf (sampling_math.h, weight_exponent). Draft 1 (the far logit) is accepted
  // with probability 1/3; rejected, the residual is uniform over logits 0 and 2.
  for (const bool tree : {false, true}) {
    VerifierInputs in = one_row({{3e38f, -3e38f, 0, -kInf}, {3e38f, -3e38f, 0, -kInf}}, {1}, tree);
    in.temperature = torch::full({1}, kInf);
    in.uniforms = torch::tensor({0.3f, 0.9f}).view({1, 2});
    EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{1, 2}));  // accepted, then the bonus at 0.9: token 2
    in.uniforms = torch::tensor({0.34f, 0.6f}).view({1, 2});
    EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{2, -1}));  // rejected: 0 or 2, each 1/2
    in.uniforms = torch::tensor({0.34f, 0.4f}).view({1, 2});
    EXPECT_EQ(tokens_of(run_both(in)), (std::vector<int64_t>{0, -1}));
  }
}

TEST(EmulatedTemperature, InfiniteTemperatureDrawsAreUniformOverSeeds) {
  const int64_t rows = 600;
  for (const bool tree : {false, true}) {
    VerifierInputs in;
    in.logits = torch::tensor({0.0f, 5.0f, -kInf, -2.0f}).repeat({rows, 1, 1});
    in.ids = torch::zeros({rows, 0}, torch::kLong);
    if (tree) in.parents = torch::zeros({rows, 0}, torch::kInt);
    in.temperature = torch::full({rows}, kInf);
    in.seed = torch::arange(rows, torch::kLong);
    const at::Tensor counts = torch::bincount(run_both(in).tokens.view({rows}), {}, 4);
    EXPECT_EQ(counts[2].item<int64_t>(), 0);
    for (const int64_t token : {0, 1, 3}) {  // a third each: a 4-sigma band
      EXPECT_NEAR(counts[token].item<int64_t>(), rows / 3, 4 * std::sqrt(rows * (1.0 / 3) * (2.0 / 3)));
    }
  }
}

}  // namespace
}  // namespace specdec_test
