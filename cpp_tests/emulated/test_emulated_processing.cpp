// process_logits under the emulator against the CPU op: bitwise (NaN payloads aside) on random
// chains and trees with ragged num_draft, repeated draft tokens, every processor, a grammar bitmask
// (V not a multiple of 32) and min_p at several temperatures, in fp32, fp16 and bf16; stale columns
// untouched; long prefixes (the kernel's shared-memory table); and the check kernel's error bits
// equal to the per-row checks of the CPU.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <limits>
#include <string>

#include "logits_processing.h"
#include "op_call.h"

namespace specdec::emulated {
// emulated_processing.cpp
std::string process_logits(const ProcessLogitsView& view);
std::string process_logits_check(const ProcessLogitsView& view, int32_t* errors);
bool process_logits_fits(const ProcessLogitsView& view);
}  // namespace specdec::emulated

namespace specdec_test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

struct ProcessingInputs {
  Tensor logits, draft_tokens, num_draft;
  OptTensor parents, output_counts, prompt_mask, logit_bias, allowed, presence, frequency, repetition, min_p,
      temperature;

  specdec::ProcessLogitsArgs args(const Tensor& target) const {
    return {target,      draft_tokens, parents,  num_draft,  output_counts, prompt_mask, logit_bias,
            allowed,     presence,     frequency, repetition, min_p,         temperature};
  }
};

void process_logits_cpu(Tensor& logits, const ProcessingInputs& in) {
  static auto op = find_op<void(Tensor&, const Tensor&, const OptTensor&, const Tensor&, const OptTensor&,
                                const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
                                const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&)>(
      "specdec_ext::process_logits");
  op.call(logits, in.draft_tokens, in.parents, in.num_draft, in.output_counts, in.prompt_mask, in.logit_bias,
          in.allowed, in.presence, in.frequency, in.repetition, in.min_p, in.temperature);
}

// Equal bit for bit, except that any NaN equals any NaN (the backends' NaN payloads may differ).
void expect_same(const Tensor& a, const Tensor& b) {
  const Tensor fa = a.to(at::kFloat), fb = b.to(at::kFloat);
  ASSERT_TRUE(torch::equal(fa.isnan(), fb.isnan()));
  const Tensor za = torch::where(fa.isnan(), torch::zeros_like(fa), fa);
  const Tensor zb = torch::where(fb.isnan(), torch::zeros_like(fb), fb);
  EXPECT_TRUE(torch::equal(za, zb)) << "max difference " << (za - zb).abs().nan_to_num(0, 1e30, 1e30).max();
}

// Random inputs: draft tokens drawn from a few ids so prefixes repeat tokens, sparse counts,
// prompt and bias, a bitmask allowing ~3/4 of the tokens, per-row parameters with edge values.
ProcessingInputs random_inputs(at::Generator& gen, at::ScalarType dtype, int64_t batch, int64_t drafts,
                               int64_t vocab, bool tree) {
  ProcessingInputs in;
  const int64_t positions = drafts + 1, words = (vocab + 31) / 32;
  Tensor logits = torch::randn({batch, positions, vocab}, gen) * 3;
  logits.masked_fill_(torch::rand({batch, positions, vocab}, gen) < 0.02, -kInf);
  if (vocab > 3) logits.index_put_({0, 0, 2}, std::numeric_limits<float>::quiet_NaN());
  in.logits = logits.to(dtype);
  const int64_t pool = std::min<int64_t>(vocab, 4);
  in.draft_tokens = torch::randint(pool, {batch, drafts}, gen, torch::kLong);
  in.num_draft = torch::randint(drafts + 1, {batch}, gen, torch::kInt);
  if (batch > 0) in.num_draft.index_put_({0}, static_cast<int32_t>(drafts));
  if (tree) {
    const Tensor span = torch::arange(drafts, torch::kDouble).add(1).repeat({batch, 1});
    in.parents = (torch::rand({batch, drafts}, gen, torch::kDouble) * span).floor().to(torch::kInt) - 1;
  }
  in.output_counts = torch::randint(3, {batch, vocab}, gen, torch::kInt) *
                     (torch::rand({batch, vocab}, gen) < 0.2).to(torch::kInt);
  in.prompt_mask = torch::rand({batch, vocab}, gen) < 0.1;
  in.logit_bias = torch::randn({batch, vocab}, gen) * (torch::rand({batch, vocab}, gen) < 0.1).to(torch::kFloat);
  Tensor bits = torch::rand({batch, positions, words * 32}, gen) < 0.75;
  const Tensor weights = torch::pow(torch::full({32}, 2, torch::kLong), torch::arange(32, torch::kLong));
  in.allowed = (bits.view({batch, positions, words, 32}).to(torch::kLong) * weights).sum(-1).to(torch::kInt);
  in.presence = torch::rand({batch}, gen) * 2 - 0.5;
  in.frequency = torch::rand({batch}, gen) - 0.2;
  in.repetition = torch::rand({batch}, gen) * 1.5 + 0.4;
  if (batch > 1) in.repetition->index_put_({1}, 1.0f);
  in.min_p = torch::rand({batch}, gen) * 0.5;
  const float temperatures[] = {1.0f, 0.0f, 0.5f, kInf, 1e30f, 2.0f, 1e-6f};
  Tensor t = torch::empty({batch});
  for (int64_t b = 0; b < batch; ++b) t.index_put_({b}, temperatures[b % 7]);
  in.temperature = t;
  return in;
}

// Runs both backends on copies of the logits; they must agree; returns the CPU's result.
Tensor run_both(const ProcessingInputs& in) {
  Tensor cpu = in.logits.clone();
  process_logits_cpu(cpu, in);
  Tensor emulated = in.logits.clone();
  const specdec::ProcessLogitsView view = specdec::check_process_logits(in.args(emulated));
  EXPECT_TRUE(specdec::emulated::process_logits_fits(view));
  EXPECT_EQ(specdec::emulated::process_logits(view), "");
  expect_same(emulated, cpu);
  // Stale columns are not touched.
  for (int64_t b = 0; b < in.logits.size(0); ++b) {
    const int64_t used = in.num_draft[b].item<int32_t>();
    if (used + 1 < in.logits.size(1)) expect_same(cpu[b].slice(0, used + 1), in.logits[b].slice(0, used + 1));
  }
  return cpu;
}

TEST(EmulatedProcessing, MatchesTheCpuOpOnRandomChainsAndTrees) {
  at::Generator gen = generator(11);
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const bool tree : {false, true}) {
      for (const int64_t vocab : {1, 7, 33, 1000}) {
        for (const int64_t drafts : {0, 1, 5}) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + (tree ? " tree" : " chain") + " V=" +
                       std::to_string(vocab) + " n=" + std::to_string(drafts));
          const ProcessingInputs in = random_inputs(gen, dtype, 7, drafts, vocab, tree);
          const Tensor out = run_both(in);
          if (vocab == 1000 && drafts == 5) EXPECT_FALSE(torch::equal(out, in.logits));  // it did something
        }
      }
    }
  }
}

TEST(EmulatedProcessing, LargeVocabularyAndEachProcessorAlone) {
  at::Generator gen = generator(12);
  const ProcessingInputs all = random_inputs(gen, at::kBFloat16, 3, 4, 32001, true);
  run_both(all);
  for (int which = 0; which < 6; ++which) {
    SCOPED_TRACE("processor " + std::to_string(which));
    ProcessingInputs in = random_inputs(gen, at::kFloat, 4, 3, 517, which % 2 == 0);
    if (which != 0) in.logit_bias.reset();
    if (which != 1) in.allowed.reset();
    if (which != 2) in.presence.reset();
    if (which != 3) in.frequency.reset();
    if (which != 4) in.repetition.reset();
    if (which != 5) in.min_p.reset();
    run_both(in);
  }
}

TEST(EmulatedProcessing, LongPrefixesFillTheSharedTable) {
  at::Generator gen = generator(13);
  for (const bool tree : {false, true}) {
    // 512 drafts (the kernel's limit) over many distinct tokens: up to 512 keys in 1024 slots.
    ProcessingInputs in = random_inputs(gen, at::kFloat, 2, 512, 700, tree);
    in.draft_tokens = torch::randint(700, {2, 512}, gen, torch::kLong);
    in.draft_tokens.index_put_({0, torch::indexing::Slice(0, 100)}, 5);  // one token repeated 100 times
    in.num_draft = torch::full({2}, 512, torch::kInt);
    in.temperature = torch::ones({2});
    run_both(in);
  }
}

TEST(EmulatedProcessing, CheckKernelReportsTheCpuErrors) {
  at::Generator gen = generator(14);
  for (int error = -1; error < 7; ++error) {
    SCOPED_TRACE("error " + std::to_string(error));
    ProcessingInputs in = random_inputs(gen, at::kFloat, 300, 4, 50, true);  // more rows than threads
    in.num_draft = torch::full({300}, 4, torch::kInt);
    const int64_t row = 299;
    switch (error) {
      case 0: in.num_draft.index_put_({row}, 5); break;
      case 1: in.draft_tokens.index_put_({row, 3}, 50); break;
      case 2: in.parents->index_put_({row, 2}, 2); break;
      case 3: in.repetition->index_put_({row}, 0.0f); break;
      case 4: in.min_p->index_put_({row}, 1.5f); break;
      case 5: in.presence->index_put_({row}, kInf); break;
      case 6: in.frequency->index_put_({row}, std::numeric_limits<float>::quiet_NaN()); break;
      default: break;
    }
    Tensor target = in.logits.clone();
    const specdec::ProcessLogitsView view = specdec::check_process_logits(in.args(target));
    uint32_t expected = 0;
    for (int64_t b = 0; b < 300; ++b) expected |= specdec::row_value_errors(view, b);
    EXPECT_EQ(expected, error < 0 ? 0u : 1u << error);
    int32_t errors = 0;
    ASSERT_EQ(specdec::emulated::process_logits_check(view, &errors), "");
    EXPECT_EQ(static_cast<uint32_t>(errors), expected);
    if (error >= 0) EXPECT_THROW(process_logits_cpu(target, in), c10::Error);
  }
}

}  // namespace
}  // namespace specdec_test
