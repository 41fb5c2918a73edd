// sample_filtered, residual_probs, philox_uniforms, build_tree_mask, kv_write, kv_compact and commit_tokens under the
// emulator
// against the CPU ops: bitwise for the ops that copy, count or hash, within fp32 rounding for the
// residual (a block reduction sums in another order than the CPU loop).
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <string>

#include "emulated_kernels.h"
#include "kv_cache.h"
#include "op_call.h"
#include "sampling.h"
#include "token_buffer.h"
#include "tree.h"

namespace specdec_test {
namespace {

at::Generator generator(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

TEST(EmulatedOps, ResidualProbs) {
  at::Generator gen = generator(1);
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const int64_t vocab : {1, 7, 32000, 32001, 151936}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " V=" + std::to_string(vocab));
      const int64_t rows = 3;
      at::Tensor p = torch::softmax(torch::randn({rows, vocab}, gen) * 2, -1);
      at::Tensor q = torch::softmax(torch::randn({rows, vocab}, gen) * 2, -1);
      q[1].copy_(p[1]);  // a zero residual: p itself
      p = p.to(dtype);
      q = q.to(dtype);
      at::Tensor cpu = torch::empty({rows, vocab});
      residual_probs(p, q, cpu);
      at::Tensor emulated = torch::full({rows, vocab}, 7.0f);
      specdec::check_residual_probs(p, q, emulated);
      ASSERT_EQ(specdec::emulated::residual_probs(specdec::residual_probs_view(p, q, emulated)), "");
      EXPECT_TRUE(torch::allclose(emulated, cpu, 1e-5, 1e-9)) << (emulated - cpu).abs().max();
      EXPECT_TRUE(torch::equal(emulated[1], p[1].to(at::kFloat)));
    }
  }
}

// Every row kind in one batch: sampling rows with and without top-k / top-p, T = inf, a greedy row
// with a tie, rows drawn from seeds, and invalid rows (NaN logits, a bad filter, a bad uniform);
// probs written into a column of a [B, 3, V] buffer (the other columns untouched).
TEST(EmulatedOps, SampleFilteredMatchesTheCpu) {
  at::Generator gen = generator(4);
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const int64_t vocab : {1, 7, 4099, 32001}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " V=" + std::to_string(vocab));
      const int64_t rows = 9;
      at::Tensor logits = (torch::randn({rows, vocab}, gen) * 3).to(dtype);
      if (vocab > 1) logits[5][vocab - 1] = logits[5].max();  // a tie for the greedy row: the lowest index wins
      logits[6][0] = std::numeric_limits<float>::quiet_NaN();
      const at::Tensor temperature = torch::tensor({1.0f, 0.7f, 1.3f, 1.0f, INFINITY, 0.0f, 1.0f, -1.0f, 0.9f});
      const at::Tensor top_k = torch::tensor({0, 0, 5, 3, 2, 0, 0, 0, 0}, torch::kInt);
      const at::Tensor top_p = torch::tensor({1.0f, 0.9f, 1.0f, 0.8f, 0.5f, 1.0f, 1.0f, 1.0f, 1.0f});
      at::Tensor uniforms = torch::rand({rows, 1}, gen);
      uniforms[8][0] = 1.0f;  // outside [0, 1)
      at::Tensor cpu_probs = torch::empty({rows, vocab});
      at::Tensor cpu_tokens = torch::empty({rows}, torch::kLong);
      sample_filtered(logits, temperature, top_k, top_p, {}, {}, uniforms, cpu_probs, cpu_tokens);
      at::Tensor buffer = torch::full({rows, 3, vocab}, 7.0f);
      at::Tensor probs = buffer.select(1, 1);
      at::Tensor tokens = torch::full({rows}, 99L, torch::kLong);
      const OptTensor t(temperature), k(top_k), p(top_p), none, u(uniforms);
      const specdec::SampleFilteredArgs args{logits, {t, k, p, none, none, u}, probs, tokens};
      specdec::check_sample_filtered(args);
      ASSERT_EQ(specdec::emulated::sample_filtered(specdec::sample_filtered_view(args)), "");
      EXPECT_TRUE(torch::equal(tokens, cpu_tokens)) << tokens << cpu_tokens;
      EXPECT_TRUE(torch::allclose(probs, cpu_probs, 1e-5, 1e-7, /*equal_nan=*/true))
          << (probs - cpu_probs).abs().nan_to_num(0.0).max();
      EXPECT_TRUE(probs[6].isnan().all().item<bool>() && probs[7].isnan().all().item<bool>());  // invalid rows
      EXPECT_TRUE(torch::equal(buffer.select(1, 0), torch::full({rows, vocab}, 7.0f)));
      EXPECT_TRUE(torch::equal(buffer.select(1, 2), torch::full({rows, vocab}, 7.0f)));
      EXPECT_EQ(tokens[6].item<int64_t>(), -1);  // NaN logits
      EXPECT_EQ(tokens[7].item<int64_t>(), -5);  // negative temperature
      if (vocab > 1) EXPECT_EQ(tokens[8].item<int64_t>(), -8);  // the uniform
    }
  }
  // Draws from seeds are the CPU's too.
  const at::Tensor logits = torch::randn({4, 300}, gen);
  const at::Tensor seed = torch::tensor({3L, 4L, 5L, 6L});
  const at::Tensor offset = torch::tensor({0L, 9L, 1L << 35, 2L});
  at::Tensor cpu_probs = torch::empty({4, 300}), probs = torch::empty({4, 300});
  at::Tensor cpu_tokens = torch::empty({4}, torch::kLong), tokens = torch::empty({4}, torch::kLong);
  sample_filtered(logits, {}, {}, {}, seed, offset, {}, cpu_probs, cpu_tokens);
  const OptTensor none, seeds(seed), offsets(offset);
  const specdec::SampleFilteredArgs args{logits, {none, none, none, seeds, offsets, none}, probs, tokens};
  ASSERT_EQ(specdec::emulated::sample_filtered(specdec::sample_filtered_view(args)), "");
  EXPECT_TRUE(torch::equal(tokens, cpu_tokens));
}

TEST(EmulatedOps, PhiloxUniformsAreBitwiseTheCpuOnes) {
  const at::Tensor seed = torch::tensor({0L, 1L, -5L, (1L << 40) + 3, (1L << 62) + 1, 77L, 123456789L});
  const at::Tensor offset = torch::tensor({0L, 7L, 1L << 33, 1L, 12345L, 0L, 999L});
  at::Tensor cpu = torch::empty({7, 1000});
  philox_uniforms(seed, offset, cpu);
  at::Tensor emulated = torch::full({7, 1000}, -1.0f);
  ASSERT_EQ(specdec::emulated::philox_uniforms(specdec::philox_uniforms_view(seed, offset, emulated)), "");
  EXPECT_TRUE(torch::equal(emulated, cpu));
}

TEST(EmulatedOps, BuildTreeMaskOnRandomAndInvalidTrees) {
  at::Generator gen = generator(2);
  for (const int64_t nodes : {1, 5, 16, 33, 130}) {
    SCOPED_TRACE("N=" + std::to_string(nodes));
    const int64_t batch = 6;
    const at::Tensor span = torch::arange(nodes, torch::kDouble).add(1).repeat({batch, 1});
    at::Tensor parents = (torch::rand({batch, nodes}, gen, torch::kDouble) * span).floor().to(torch::kInt) - 1;
    at::Tensor num_nodes = torch::randint(nodes + 1, {batch}, gen, torch::kInt);
    num_nodes[0] = nodes;
    num_nodes[4] = nodes + 1;  // -10
    if (nodes > 1) parents.index_put_({5, nodes - 1}, static_cast<int32_t>(nodes - 1));  // -9
    num_nodes[5] = nodes;
    at::Tensor cpu_mask = torch::empty({batch, nodes, nodes}, torch::kBool);
    at::Tensor cpu_depth = torch::empty({batch, nodes}, torch::kInt);
    build_tree_mask(parents, num_nodes, cpu_mask, cpu_depth);
    at::Tensor mask = torch::ones({batch, nodes, nodes}, torch::kBool);  // stale trues the kernel must clear
    at::Tensor depth = torch::full({batch, nodes}, 99, torch::kInt);
    const std::optional<at::Tensor> counts(num_nodes);
    ASSERT_EQ(specdec::emulated::build_tree_mask(specdec::tree_mask_view(parents, counts, mask, depth)), "");
    EXPECT_TRUE(torch::equal(mask, cpu_mask));
    EXPECT_TRUE(torch::equal(depth, cpu_depth)) << depth << cpu_depth;
    EXPECT_EQ(depth[4][0].item<int32_t>(), -10);
  }
}

TEST(EmulatedOps, KvWriteWithStridesAndSkippedSlots) {
  at::Generator gen = generator(3);
  for (const at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const int64_t head_dim : {1, 8, 80, 128}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + " D=" + std::to_string(head_dim));
      const int64_t batch = 3, tokens = 5, heads = 3, pages = 6, page_size = 4;
      // HF's layout: [B, H, T, D] transposed to [B, T, H, D] without a copy.
      const at::Tensor key = torch::randn({batch, heads, tokens, head_dim}, gen).to(dtype).transpose(1, 2);
      const at::Tensor value = torch::randn({batch, tokens, heads, head_dim}, gen).to(dtype);
      at::Tensor slots = torch::randperm(pages * page_size, gen, torch::kLong).slice(0, 0, batch * tokens).view({batch, tokens});
      slots.index_put_({0, 1}, -1);             // padding
      slots.index_put_({2, 4}, pages * page_size + 3);  // past the pool: skipped
      at::Tensor cpu = torch::randn({2, pages, page_size, heads, head_dim}, gen).to(dtype);
      at::Tensor emulated = cpu.clone();
      kv_write(key, value, slots, cpu);
      specdec::check_kv_write(key, value, slots, emulated);
      ASSERT_EQ(specdec::emulated::kv_write(specdec::kv_write_view(key, value, slots, emulated)), "");
      EXPECT_TRUE(torch::equal(emulated, cpu));
    }
  }
}

TEST(EmulatedOps, KvCompactMovesAcceptedPathsInOrder) {
  at::Generator gen = generator(4);
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const int64_t batch = 4, pages = 12, page_size = 4, max_pages = 3, layers = 2;
    at::Tensor cpu = torch::randn({2 * layers, pages, page_size, 2, 16}, gen).to(dtype);
    at::Tensor emulated = cpu.clone();
    const at::Tensor tables = torch::randperm(pages, gen, torch::kInt).view({batch, max_pages});
    // Sources strictly increasing after dst_start (the tree case), -1 ending some rows early,
    // positions past the table skipped.
    at::Tensor src = torch::tensor({5L, 7L, 8L, 11L, 3L, 4L, -1L, 9L, 6L, 10L, 11L, 40L, 2L, 9L, 10L, 11L}).view({batch, 4});
    const at::Tensor dst = torch::tensor({4L, 1L, 5L, 2L});
    kv_compact(cpu, tables, src, dst);
    specdec::check_kv_compact(emulated, tables, src, dst);
    ASSERT_EQ(specdec::emulated::kv_compact(specdec::kv_compact_view(emulated, tables, src, dst)), "");
    EXPECT_TRUE(torch::equal(emulated, cpu));
  }
}

TEST(EmulatedOps, CommitTokensIsTheCpuCommit) {
  at::Generator gen = generator(9);
  const int64_t batch = 300, width = 5, capacity = 12;  // more rows than one block of the kernel's threads
  // tokens as a column slice of a wider buffer (row stride 7); accepted counts from -2 (a RowStatus) to
  // width (clamped); every fourth row frozen; lengths up to the capacity (writes past it skipped)
  const at::Tensor tokens = torch::randint(0, 1000, {batch, width + 2}, gen, torch::kLong).slice(1, 1, 1 + width);
  const at::Tensor accepted = torch::randint(-2, width + 1, {batch}, gen, torch::kInt);
  const at::Tensor active = torch::arange(batch) % 4 != 3;
  const at::Tensor lengths = torch::randint(0, capacity + 1, {batch}, gen, torch::kLong);
  const at::Tensor buffer = torch::randint(0, 1000, {batch, capacity}, gen, torch::kLong);
  const at::Tensor next = torch::full({batch, 3}, -5L);
  at::Tensor cpu_buffer = buffer.clone(), cpu_lengths = lengths.clone(), cpu_kept = torch::full({batch}, -1L);
  at::Tensor cpu_next = next.clone();
  commit_tokens(tokens, accepted, active, cpu_buffer, cpu_lengths, cpu_kept, cpu_next);
  at::Tensor buffer_e = buffer.clone(), lengths_e = lengths.clone(), kept_e = torch::full({batch}, -1L);
  at::Tensor next_e = next.clone();
  specdec::check_commit_tokens(tokens, accepted, active, buffer_e, lengths_e, kept_e, next_e);
  ASSERT_EQ(specdec::emulated::commit_tokens(
                specdec::commit_tokens_view(tokens, accepted, active, buffer_e, lengths_e, kept_e, next_e)),
            "");
  EXPECT_TRUE(torch::equal(buffer_e, cpu_buffer));
  EXPECT_TRUE(torch::equal(lengths_e, cpu_lengths));
  EXPECT_TRUE(torch::equal(kept_e, cpu_kept));
  EXPECT_TRUE(torch::equal(next_e, cpu_next));
  EXPECT_GT(cpu_kept.sum().item<int64_t>(), batch);  // the case commits something
}

}  // namespace
}  // namespace specdec_test
