// The CPU forward kernels (csrc/cpu/small_gemm.h, fused_linear.h, rope_cache.h, attention.h) against
// double-precision references, on every instruction-set path this CPU runs (forced through
// SPECDEC_CPU_ISA as the ops read it), odd shapes, 1 and 16 rows, fp32/bf16/fp16 weights and caches;
// the 16-bit conversions against c10's; batch invariance; the ops through the dispatcher (decoder_layers and
// greedy_chain over the model lists of csrc/lean_forward.h, read back by name with llama_model_view).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpu/attention.h"
#include "cpu/fused_linear.h"
#include "cpu/isa.h"
#include "cpu/numeric.h"
#include "cpu/rope_cache.h"
#include "lean_forward.h"

namespace {

using namespace specdec::cpu;

constexpr double kFp32Eps = 5.9604644775390625e-8;  // 2^-24

// The paths this CPU runs, each forced through the environment as a test of the switch itself.
std::vector<Isa> paths() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512Bf16, Isa::kAmxBf16}) {
    if (!isa_supported(isa)) continue;
    setenv("SPECDEC_CPU_ISA", isa_name(isa), 1);
    EXPECT_EQ(selected_isa(), isa);
    out.push_back(isa);
  }
  unsetenv("SPECDEC_CPU_ISA");
  return out;
}

std::vector<uint16_t> to_bits(const std::vector<float>& values, DType type) {
  std::vector<uint16_t> out(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    out[i] = type == DType::kBF16 ? float_to_bf16(values[i]) : float_to_fp16(values[i]);
  return out;
}

struct Matrix {  // a weight in one dtype and its exact values as doubles
  DType type;
  int64_t rows, cols;
  std::vector<float> f32;
  std::vector<uint16_t> half;
  std::vector<double> exact;

  Matrix(DType t, int64_t r, int64_t c, std::mt19937& rng) : type(t), rows(r), cols(c) {
    std::normal_distribution<float> normal(0.0f, 0.1f);
    f32.resize(r * c);
    for (float& v : f32) v = normal(rng);
    if (t != DType::kF32) half = to_bits(f32, t);
    exact.resize(r * c);
    for (int64_t i = 0; i < r * c; ++i) exact[i] = t == DType::kF32 ? f32[i] : load_as_float(t, half.data(), i);
  }
  GemmWeight weight() const {
    return {t_data(), type, rows, cols, cols};
  }
  const void* t_data() const { return type == DType::kF32 ? static_cast<const void*>(f32.data()) : half.data(); }
};

// fused_linear_range over every output tile of one weight; activations from x rounded as asked.
std::vector<float> run_linear(Isa isa, const std::vector<float>& x, int64_t M, const Matrix& w, bool bf16,
                              const float* norm, LinearEpilogue epilogue = LinearEpilogue::kStore,
                              const Matrix* up = nullptr, std::vector<float> init = {}, bool weights_cached = false) {
  const int64_t K = w.cols;
  ActivationBuffers buffers;
  const GemmActivations a = prepare_gemm_activations(isa, x.data(), M, K, norm, 1e-5f, bf16, weights_cached, buffers);
  std::vector<float> out = init.empty() ? std::vector<float>(M * w.rows, NAN) : init;
  std::vector<unsigned char> panels[2];
  GemmWeight ws[2] = {with_panels(isa, a, w.weight(), panels[0]),
                      with_panels(isa, a, up ? up->weight() : w.weight(), panels[1])};
  LinearOutput os[2] = {{out.data(), w.rows, nullptr}, {nullptr, 0, nullptr}};
  const int count = epilogue == LinearEpilogue::kSwiGLU ? 2 : 1;
  fused_linear_range(isa, a, M, epilogue, ws, os, count, 0, fused_linear_num_tiles(epilogue, ws, count), weights_cached);
  return out;
}

double reference_activation(const std::vector<float>& x, int64_t m, int64_t k, int64_t K, bool bf16) {
  const float v = x[m * K + k];
  return bf16 ? round_to_bf16(v) : v;
}

TEST(LeanForwardKernels, ConversionsMatchC10) {
  std::mt19937 rng(1);
  std::uniform_int_distribution<uint32_t> bits;
  std::vector<float> values = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.0f, 65520.0f, 1e-8f, 6.1e-5f, 5.96e-8f,
                               2.98e-8f, 3.0e-8f, -7.5e-6f, 3.3895e38f, INFINITY, -INFINITY};
  for (int i = 0; i < 200000; ++i) {
    const float f = bits_to_float(bits(rng));
    if (!std::isnan(f)) values.push_back(f);
  }
  for (float f : values) {
    EXPECT_EQ(float_to_bf16(f), c10::BFloat16(f).x) << f;
    EXPECT_EQ(float_to_fp16(f), c10::Half(f).x) << f;
    EXPECT_EQ(bf16_to_float(float_to_bf16(f)), static_cast<float>(c10::BFloat16(f))) << f;
    EXPECT_EQ(fp16_to_float(float_to_fp16(f)), static_cast<float>(c10::Half(f))) << f;
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(NAN))));
  EXPECT_TRUE(std::isnan(fp16_to_float(float_to_fp16(NAN))));
  for (uint32_t h = 0; h < 0x10000; ++h) {  // every fp16 widens exactly
    c10::Half half;
    half.x = static_cast<uint16_t>(h);
    const float expected = static_cast<float>(half);
    if (!std::isnan(expected)) EXPECT_EQ(fp16_to_float(static_cast<uint16_t>(h)), expected) << h;
  }
}

TEST(LeanForwardKernels, GemmMatchesDoubleReferenceOnEveryPath) {
  struct Shape {
    int64_t M, K, N;
  };
  const Shape shapes[] = {{1, 16, 4}, {1, 77, 33}, {16, 77, 33}, {16, 31, 5}, {5, 512, 130}, {3, 1280, 17},
                          {9, 64, 64}};
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (Isa isa : paths()) {
    for (const Shape& s : shapes) {
      for (DType type : {DType::kF32, DType::kBF16, DType::kF16}) {
        const Matrix w(type, s.N, s.K, rng);
        std::vector<float> x(s.M * s.K);
        for (float& v : x) v = normal(rng);
        for (bool bf16 : {false, true}) {
          if (bf16 && type != DType::kBF16) continue;
          const std::vector<float> out = run_linear(isa, x, s.M, w, bf16, nullptr);
          for (int64_t m = 0; m < s.M; ++m)
            for (int64_t n = 0; n < s.N; ++n) {
              double expected = 0.0, magnitude = 0.0;
              for (int64_t k = 0; k < s.K; ++k) {
                const double term = reference_activation(x, m, k, s.K, bf16) * w.exact[n * s.K + k];
                expected += term;
                magnitude += std::fabs(term);
              }
              ASSERT_NEAR(out[m * s.N + n], expected, 4.0 * s.K * kFp32Eps * magnitude + 1e-30)
                  << isa_name(isa) << " M=" << s.M << " K=" << s.K << " N=" << s.N << " m=" << m << " n=" << n;
            }
        }
      }
    }
  }
}

TEST(LeanForwardKernels, RowsAreBatchInvariant) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t K = 83, N = 37;
  std::vector<float> x(16 * K), norm(K);
  for (float& v : x) v = normal(rng);
  for (float& v : norm) v = 1.0f + 0.1f * normal(rng);
  for (Isa isa : paths()) {
    for (DType type : {DType::kF32, DType::kBF16, DType::kF16}) {
      const Matrix w(type, N, K, rng);
      const bool bf16 = type == DType::kBF16;
      const std::vector<float> all = run_linear(isa, x, 16, w, bf16, norm.data());
      for (int64_t M : {1, 3, 4, 5, 6, 7, 9, 11, 13}) {  // every block split of the paths (e.g. 6, 4 + 3, 5 + 4 + 4)
        const std::vector<float> part(x.begin(), x.begin() + M * K);
        const std::vector<float> out = run_linear(isa, part, M, w, bf16, norm.data());
        for (int64_t i = 0; i < M * N; ++i) ASSERT_EQ(out[i], all[i]) << isa_name(isa) << " M=" << M << " i=" << i;
      }
    }
  }
}

// A one-row pass over cached weights (a draft's: the path's wide tiles at a time) gives the streamed pass's
// bits, for every width (whole groups of 16 features, a remainder, fewer than 16), every K (a masked
// tail, under one vector), each dtype and epilogue, on every path.
TEST(LeanForwardKernels, CachedWeightsGiveTheStreamedBits) {
  std::mt19937 rng(13);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (Isa isa : paths()) {
    for (DType type : {DType::kBF16, DType::kF32, DType::kF16}) {
      for (auto [N, K] : {std::pair<int64_t, int64_t>{64, 128}, {37, 83}, {120, 120}, {12, 20}, {48, 1280}}) {
        std::vector<float> x(K), residual(N);
        for (float& v : x) v = normal(rng);
        for (float& v : residual) v = normal(rng);
        const Matrix w(type, N, K, rng), up(type, N, K, rng);
        const bool bf16 = type == DType::kBF16;
        for (LinearEpilogue e : {LinearEpilogue::kStore, LinearEpilogue::kAdd, LinearEpilogue::kSwiGLU}) {
          const Matrix* second = e == LinearEpilogue::kSwiGLU ? &up : nullptr;
          const std::vector<float> init = e == LinearEpilogue::kAdd ? residual : std::vector<float>{};
          // (amxbf16's AMX route is for streamed weights: its cached passes are avx512bf16's, simd/amx.h)
          const Isa cached_path = isa == Isa::kAmxBf16 ? Isa::kAvx512Bf16 : isa;
          const std::vector<float> streamed = run_linear(cached_path, x, 1, w, bf16, nullptr, e, second, init, false);
          const std::vector<float> cached = run_linear(isa, x, 1, w, bf16, nullptr, e, second, init, true);
          for (int64_t n = 0; n < N; ++n)
            ASSERT_EQ(cached[n], streamed[n]) << isa_name(isa) << " N=" << N << " K=" << K << " n=" << n;
          // and a row of a many-row pass
          std::vector<float> x3(x);
          for (int64_t k = 0; k < 2 * K; ++k) x3.push_back(normal(rng));
          std::vector<float> init3 = init;
          if (!init.empty()) init3.resize(3 * N, 0.5f);
          const std::vector<float> many = run_linear(isa, x3, 3, w, bf16, nullptr, e, second, init3, true);
          for (int64_t n = 0; n < N; ++n) ASSERT_EQ(many[n], streamed[n]) << isa_name(isa) << " N=" << N << " n=" << n;
        }
      }
    }
  }
}

TEST(LeanForwardKernels, ResidualAddAndSwiGLU) {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t M = 6, K = 45, N = 23;
  std::vector<float> x(M * K), residual(M * N);
  for (float& v : x) v = normal(rng);
  for (float& v : residual) v = normal(rng);
  for (Isa isa : paths()) {
    const Matrix gate(DType::kBF16, N, K, rng), up(DType::kBF16, N, K, rng);
    const std::vector<float> added = run_linear(isa, x, M, gate, false, nullptr, LinearEpilogue::kAdd, nullptr, residual);
    const std::vector<float> gated = run_linear(isa, x, M, gate, false, nullptr, LinearEpilogue::kSwiGLU, &up);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double g = 0.0, u = 0.0, mag = 0.0;
        for (int64_t k = 0; k < K; ++k) {
          g += x[m * K + k] * gate.exact[n * K + k];
          u += x[m * K + k] * up.exact[n * K + k];
          mag += std::fabs(x[m * K + k]) * (std::fabs(gate.exact[n * K + k]) + std::fabs(up.exact[n * K + k]));
        }
        const double tol = 4.0 * K * kFp32Eps * mag * 4 + 1e-6;
        EXPECT_NEAR(added[m * N + n], residual[m * N + n] + g, tol) << isa_name(isa);
        EXPECT_NEAR(gated[m * N + n], g / (1.0 + std::exp(-g)) * u, tol) << isa_name(isa);
      }
  }
}

// (The SwiGLU epilogue's four lanes against the scalar silu: cpp_tests/isa/test_isa_kernels.cpp.)

TEST(LeanForwardKernels, RopeAndCacheWrite) {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t M = 5, H = 6, Hk = 3, D = 18, P = 20, capacity = 8, half = D / 2;
  std::vector<float> q(M * H * D), k(M * Hk * D), v(M * Hk * D), cos(P * half), sin(P * half);
  for (float& x : q) x = normal(rng);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = p * std::pow(10000.0, -2.0 * i / D);
      cos[p * half + i] = static_cast<float>(std::cos(angle));
      sin[p * half + i] = static_cast<float>(std::sin(angle));
    }
  const std::vector<int64_t> positions = {0, 19, 3, 7, 7}, rows = {0, 1, 1, 0, 1}, slots = {2, 0, 7, 5, 3};
  const std::vector<float> q0 = q;
  std::vector<uint16_t> kc(2 * Hk * capacity * D), vc(kc.size());
  RopeCacheProblem p{q.data(), H * D, k.data(), Hk * D, v.data(), Hk * D, H, Hk, D, cos.data(), sin.data(),
                     positions.data(), rows.data(), slots.data(), kc.data(), vc.data(), DType::kBF16, capacity};
  rope_cache_rows(p, 0, M);
  auto rotated = [&](const std::vector<float>& x, int64_t heads, int64_t m, int64_t h, int64_t i) {
    const double c = cos[positions[m] * half + i % half], s = sin[positions[m] * half + i % half];
    const double x1 = x[(m * heads + h) * D + i % half], x2 = x[(m * heads + h) * D + i % half + half];
    return i < half ? x1 * c - x2 * s : x2 * c + x1 * s;
  };
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < D; ++i) EXPECT_NEAR(q[(m * H + h) * D + i], rotated(q0, H, m, h, i), 1e-6);
    for (int64_t g = 0; g < Hk; ++g)
      for (int64_t i = 0; i < D; ++i) {
        const int64_t at = ((rows[m] * Hk + g) * capacity + slots[m]) * D + i;
        const double expected = rotated(k, Hk, m, g, i);
        EXPECT_NEAR(bf16_to_float(kc[at]), expected, std::fabs(expected) * 0.0040 + 1e-7);
        EXPECT_EQ(vc[at], float_to_bf16(v[(m * Hk + g) * D + i]));
      }
  }
}

// softmax(scale q K^T) V over the prefix and the visible block keys, in double.
void reference_attention(const AttentionProblem& p, const std::vector<float>& kc, const std::vector<float>& vc,
                         std::vector<double>& out) {
  const int64_t D = p.head_dim;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t t = 0; t < p.tokens; ++t)
      for (int64_t h = 0; h < p.heads; ++h) {
        std::vector<int64_t> keys(p.tokens);
        const int64_t n = attention_keys(p, b, t, keys.data());
        const int64_t g = h / (p.heads / p.kv_heads);
        std::vector<double> s(n);
        double top = -INFINITY, total = 0.0;
        auto slot = [&](int64_t i) { return i < p.start[b] ? i : keys[i - p.start[b]]; };
        for (int64_t i = 0; i < n; ++i) {
          s[i] = 0.0;
          for (int64_t d = 0; d < D; ++d)
            s[i] += p.q[((b * p.tokens + t) * p.heads + h) * D + d] *
                    kc[((p.cache_row(b) * p.kv_heads + g) * p.capacity + slot(i)) * D + d];
          s[i] *= p.scale;
          top = std::max(top, s[i]);
        }
        for (int64_t i = 0; i < n; ++i) total += (s[i] = std::exp(s[i] - top));
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0.0;
          for (int64_t i = 0; i < n; ++i) acc += s[i] * vc[((p.cache_row(b) * p.kv_heads + g) * p.capacity + slot(i)) * D + d];
          out[((b * p.tokens + t) * p.heads + h) * D + d] = acc / total;
        }
      }
}

TEST(LeanForwardKernels, AttentionMatchesDoubleReferenceChainsAndTrees) {
  std::mt19937 rng(6);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t D : {64, 80, 24, 160}) {
    const int64_t B = 2, T = 5, H = 4, Hk = 2, capacity = 40;
    std::vector<float> q(B * T * H * D), kc(B * Hk * capacity * D), vc(kc.size());
    for (float& x : q) x = normal(rng);
    for (float& x : kc) x = normal(rng);
    for (float& x : vc) x = normal(rng);
    // a tree per row: token t's parent is an earlier token
    std::vector<uint8_t> visible(B * T * T, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        visible[(b * T + t) * T + t] = 1;
        if (t == 0) continue;
        const int64_t parent = std::uniform_int_distribution<int64_t>(0, t - 1)(rng);
        for (int64_t j = 0; j < T; ++j) visible[(b * T + t) * T + j] |= visible[(b * T + parent) * T + j];
      }
    const std::vector<int64_t> start = {0, 31};
    const std::vector<int64_t> swapped = {1, 0};  // batch row b reads cache row 1 - b
    for (const uint8_t* mask : {static_cast<const uint8_t*>(nullptr), static_cast<const uint8_t*>(visible.data())})
    for (const int64_t* rows : {static_cast<const int64_t*>(nullptr), swapped.data()}) {
      std::vector<float> out(q.size());
      AttentionProblem p{q.data(), kc.data(), vc.data(), DType::kF32, start.data(), mask, B, T, H, Hk, D,
                         capacity, 0.125f, out.data(), rows};
      std::vector<double> expected(q.size());
      reference_attention(p, kc, vc, expected);
      for (Isa isa : paths()) {
        std::vector<float> scratch(attention_scratch_floats(capacity, T));
        std::vector<int64_t> keys(attention_scratch_keys(T));
        cache_attention_range(isa, p, 0, attention_num_tasks(p), scratch.data(), keys.data());
        for (size_t i = 0; i < out.size(); ++i)
          ASSERT_NEAR(out[i], expected[i], 2e-5) << isa_name(isa) << " D=" << D << " tree=" << (mask != nullptr)
                                                 << " rows mapped=" << (rows != nullptr);
      }
    }
  }
}

TEST(LeanForwardKernels, ForcingAnUnknownPathThrows) {
  setenv("SPECDEC_CPU_ISA", "sse9", 1);
  EXPECT_THROW(selected_isa(), std::invalid_argument);
  unsetenv("SPECDEC_CPU_ISA");
  EXPECT_EQ(selected_isa(), best_isa());
}

// The ops through the dispatcher, as a torch user calls them (typed once).
using Biases = c10::List<std::optional<at::Tensor>>;

auto& fused_linear_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdec_ext::fused_linear", "")
                       .typed<void(const at::Tensor&, const std::optional<at::Tensor>&, double, at::TensorList,
                                   const Biases&, const std::string&, bool, at::TensorList)>();
  return op;
}

auto& decoder_layers_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("specdec_ext::decoder_layers", "")
                       .typed<void(at::Tensor&, const Biases&, at::ArrayRef<double>, bool, at::TensorList,
                                   at::TensorList, at::TensorList, const std::optional<at::Tensor>&)>();
  return op;
}

// decoder_layers' and greedy_chain's model lists (csrc/lean_forward.h) for L layers: fp32 norms near
// 1, bf16 projections, no biases but the head's; and the same read back by name.
struct ModelLists {
  Biases weights;
  std::vector<double> scalars;
  specdec::LlamaModelView view() const { return specdec::llama_model_view("test", weights, scalars); }
};

ModelLists model_lists(int64_t L, int64_t d, int64_t H, int64_t Hk, int64_t D, int64_t I, int64_t V) {
  const auto norm = [d] { return torch::ones({d}) + 0.1 * torch::randn({d}); };
  const auto projection = [](int64_t rows, int64_t columns) {
    return (0.2 * torch::randn({rows, columns})).to(torch::kBFloat16);
  };
  ModelLists m;
  m.weights.push_back(torch::randn({V, d}).to(torch::kBFloat16));  // embed
  for (int64_t l = 0; l < L; ++l) {
    m.weights.push_back(norm());  // input_norm, then each projection and its bias (none)
    for (auto [rows, columns] :
         std::vector<std::pair<int64_t, int64_t>>{{H * D, d}, {Hk * D, d}, {Hk * D, d}, {d, H * D}}) {
      m.weights.push_back(projection(rows, columns));
      m.weights.push_back(std::nullopt);
    }
    m.weights.push_back(norm());  // post_norm
    for (auto [rows, columns] : std::vector<std::pair<int64_t, int64_t>>{{I, d}, {I, d}, {d, I}}) {
      m.weights.push_back(projection(rows, columns));
      m.weights.push_back(std::nullopt);
    }
    m.scalars.insert(m.scalars.end(), {1e-6, 1e-6});
  }
  m.weights.push_back(norm());
  m.weights.push_back(projection(V, d));
  m.weights.push_back(torch::randn({V}));  // head_bias
  m.scalars.insert(m.scalars.end(), {1e-6, 0.4});  // the final norm's epsilon, the attention scale
  return m;
}

// Rotary tables [capacity, D/2] (cos, sin).
std::pair<at::Tensor, at::Tensor> rope_tables(int64_t capacity, int64_t D) {
  const at::Tensor freqs = torch::arange(capacity, torch::kFloat).unsqueeze(1) *
                           torch::pow(10000.0, -torch::arange(0, D, 2, torch::kFloat) / D).unsqueeze(0);
  return {freqs.cos().contiguous(), freqs.sin().contiguous()};
}

TEST(LeanForwardOps, FusedLinearThroughTheDispatcher) {
  auto& op = fused_linear_op();
  torch::manual_seed(0);
  const at::Tensor x = torch::randn({3, 40});
  const at::Tensor w = torch::randn({10, 40}).to(torch::kBFloat16);
  at::Tensor out = torch::empty({3, 10});
  Biases biases;
  const std::string store = "store";
  op.call(x, std::nullopt, 0.0, {w}, biases, store, true, {out});
  const at::Tensor expected = torch::matmul(x.to(torch::kBFloat16).to(torch::kFloat), w.to(torch::kFloat).t());
  EXPECT_TRUE(torch::allclose(out, expected, 1e-5, 1e-5));
  EXPECT_THROW(op.call(x, std::nullopt, 0.0, {w.to(torch::kFloat)}, biases, store, true, {out}), c10::Error);
}

TEST(LeanForwardOps, DecoderLayersThroughTheDispatcherIsThePerOpComposition) {
  auto& layers = decoder_layers_op();
  auto& linear = fused_linear_op();
  static auto rope = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("specdec_ext::rope_cache_write", "")
                         .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                     at::Tensor&, at::Tensor&)>();
  static auto attention = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("specdec_ext::cache_attention", "")
                              .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const std::optional<at::Tensor>&, double, at::Tensor&)>();
  torch::manual_seed(1);
  const int64_t L = 2, d = 24, H = 4, Hk = 2, D = 6, I = 40, B = 2, T = 3, M = B * T, Bc = 3, capacity = 16;
  const ModelLists model = model_lists(L, d, H, Hk, D, I, 30);
  const at::Tensor x0 = torch::randn({M, d});
  const at::Tensor positions = torch::tensor({4, 5, 6, 0, 1, 2}, torch::kLong);
  const at::Tensor rows = torch::tensor({2, 2, 2, 0, 0, 0}, torch::kLong);
  const at::Tensor start = torch::tensor({4, 0}, torch::kLong);
  const auto [cos, sin] = rope_tables(capacity, D);
  const at::Tensor kc0 = torch::randn({L, Bc, Hk, capacity, D}).to(torch::kBFloat16), vc0 = torch::randn_like(kc0);
  Biases none;

  at::Tensor x = x0.clone(), kc = kc0.clone(), vc = vc0.clone();
  layers.call(x, model.weights, model.scalars, true, {cos, sin}, {kc, vc}, {positions, rows, positions, start},
              std::nullopt);

  at::Tensor y = x0.clone(), kc2 = kc0.clone(), vc2 = vc0.clone();
  at::Tensor q = torch::empty({M, H * D}), k = torch::empty({M, Hk * D}), v = torch::empty({M, Hk * D});
  at::Tensor out = torch::empty({B, T, H, D}), act = torch::empty({M, I});
  const at::Tensor row_of_batch = torch::tensor({2, 0}, torch::kLong);
  const specdec::LlamaModelView view = model.view();
  for (int64_t l = 0; l < L; ++l) {
    const specdec::LlamaLayerView& w = view.layers[l];
    linear.call(y, w.input_norm, w.input_norm_eps, {w.q.weight, w.k.weight, w.v.weight}, none, "store", true,
                {q, k, v});
    at::Tensor qh = q.view({M, H, D}), kl = kc2.select(0, l), vl = vc2.select(0, l);
    rope.call(qh, k.view({M, Hk, D}), v.view({M, Hk, D}), cos, sin, positions, rows, positions, kl, vl);
    attention.call(q.view({B, T, H, D}), kl.index_select(0, row_of_batch), vl.index_select(0, row_of_batch), start,
                   std::nullopt, view.scale, out);
    linear.call(out.view({M, H * D}), std::nullopt, 0.0, {w.o.weight}, none, "add", true, {y});
    linear.call(y, w.post_norm, w.post_norm_eps, {w.gate.weight, w.up.weight}, none, "swiglu", true, {act});
    linear.call(act, std::nullopt, 0.0, {w.down.weight}, none, "add", true, {y});
  }
  EXPECT_TRUE(torch::equal(x, y));
  EXPECT_TRUE(torch::equal(kc, kc2));
  EXPECT_TRUE(torch::equal(vc, vc2));
  const std::vector<double> short_scalars(model.scalars.begin(), model.scalars.end() - 1);
  EXPECT_THROW(layers.call(x, model.weights, short_scalars, true, {cos, sin}, {kc, vc},
                           {positions, rows, positions, start}, std::nullopt),
               c10::Error);
  Biases no_norm = model.weights.copy();
  no_norm.set(1, std::nullopt);  // layer 0's input_norm
  EXPECT_THROW(layers.call(x, no_norm, model.scalars, true, {cos, sin}, {kc, vc}, {positions, rows, positions, start},
                           std::nullopt),
               c10::Error);
}

TEST(LeanForwardOps, GreedyChainThroughTheDispatcherIsTheStepLoop) {
  static auto chain = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("specdec_ext::greedy_chain", "")
                          .typed<void(at::Tensor&, int64_t, const Biases&, at::ArrayRef<double>, bool,
                                      at::TensorList, at::TensorList, at::TensorList, int64_t, bool)>();
  auto& layers = decoder_layers_op();
  auto& linear = fused_linear_op();
  torch::manual_seed(2);
  const int64_t L = 2, d = 24, H = 4, Hk = 2, D = 6, I = 40, V = 50, B = 2, n = 5, steps = 4, capacity = 16;
  const ModelLists model = model_lists(L, d, H, Hk, D, I, V);
  const specdec::LlamaModelView view = model.view();
  const at::Tensor embed = view.embed, head = view.head.weight, norm = view.norm, head_bias = *view.head.bias;
  const auto [cos, sin] = rope_tables(capacity, D);
  const at::Tensor kc0 = torch::randn({L, B, Hk, capacity, D}).to(torch::kBFloat16), vc0 = torch::randn_like(kc0);
  const at::Tensor rows = torch::tensor({1, 0}, torch::kLong), start = torch::tensor({7, 2}, torch::kLong);
  const int64_t limit = V - 9;
  const auto call = [&](at::Tensor& tokens, int64_t count, const Biases& weights, at::Tensor& k, at::Tensor& v,
                        std::vector<at::Tensor> chain_rows, bool check) {
    chain.call(tokens, count, weights, model.scalars, true, {cos, sin}, {k, v}, chain_rows, limit, check);
  };

  at::Tensor tokens = torch::zeros({B, n}, torch::kLong), kc = kc0.clone(), vc = vc0.clone();
  tokens.select(1, 0).copy_(torch::tensor({4, 31}, torch::kLong));
  call(tokens, steps, model.weights, kc, vc, {rows, start}, /*check=*/true);

  at::Tensor logits = torch::empty({B, V});
  // The separate calls a chain replaces: from column 0 of `expected`, one-token passes from slot `from`.
  const auto step_loop = [&](at::Tensor& expected, const at::Tensor& from, at::Tensor& k, at::Tensor& v) {
    for (int64_t i = 1; i < steps; ++i) {
      at::Tensor x = embed.index_select(0, expected.select(1, i - 1)).to(torch::kFloat).contiguous();
      const at::Tensor slots = from + (i - 1);
      layers.call(x, model.weights, model.scalars, true, {cos, sin}, {k, v}, {slots, rows, slots, slots},
                  std::nullopt);
      linear.call(x, norm, view.norm_eps, {head}, Biases({head_bias}), "store", true, {logits});
      expected.select(1, i).copy_(logits.slice(1, 0, limit).argmax(1));
    }
  };
  at::Tensor expected = torch::zeros({B, n}, torch::kLong), kc2 = kc0.clone(), vc2 = vc0.clone();
  expected.select(1, 0).copy_(tokens.select(1, 0));
  step_loop(expected, start, kc2, vc2);
  EXPECT_TRUE(torch::equal(tokens, expected));
  EXPECT_TRUE(torch::equal(kc, kc2));
  EXPECT_TRUE(torch::equal(vc, vc2));
  EXPECT_THROW(call(tokens, n + 1, model.weights, kc, vc, {rows, start}, false), c10::Error);
  // three slots from capacity - 2: refused before the first step writes its slot
  const at::Tensor late = torch::tensor({capacity - 2, int64_t{0}}, torch::kLong);
  const at::Tensor kc_before = kc.clone();
  EXPECT_THROW(call(tokens, steps, model.weights, kc, vc, {rows, late}, false), c10::Error);
  EXPECT_TRUE(torch::equal(kc, kc_before));
  // check_logits: a NaN logit (a head row of NaN) is a ValueError naming the row, not an argmax
  const at::Tensor nan_head = head.clone();
  nan_head.select(0, 3).fill_(std::numeric_limits<float>::quiet_NaN());
  Biases nan_weights = model.weights.copy();
  nan_weights.set(nan_weights.size() - 2, nan_head);
  call(tokens, steps, nan_weights, kc, vc, {rows, start}, false);
  EXPECT_EQ(tokens[0][1].item<int64_t>(), 3);  // torch.argmax's answer: the NaN's index
  EXPECT_EQ(tokens[1][1].item<int64_t>(), 3);
  EXPECT_THROW(call(tokens, steps, nan_weights, kc, vc, {rows, start}, true), c10::ValueError);

  // a feed: the block's pass (padding in row 1's second column), the argmax at each row's last real
  // column, then the chain from the slot after the feed
  const at::Tensor feed = torch::tensor({{9, 14}, {22, 22}}, torch::kLong), counts = torch::tensor({2, 1}, torch::kLong);
  at::Tensor fed_tokens = torch::zeros({B, n}, torch::kLong), kc3 = kc0.clone(), vc3 = vc0.clone();
  call(fed_tokens, steps, model.weights, kc3, vc3, {rows, start, feed, counts}, false);
  at::Tensor kc4 = kc0.clone(), vc4 = vc0.clone(), fed_expected = torch::zeros({B, n}, torch::kLong);
  at::Tensor block = embed.index_select(0, feed.reshape({-1})).to(torch::kFloat).contiguous();
  const at::Tensor block_slots = (start.unsqueeze(1) + torch::arange(2, torch::kLong)).reshape({-1});
  layers.call(block, model.weights, model.scalars, true, {cos, sin}, {kc4, vc4},
              {block_slots, rows.repeat_interleave(2), block_slots, start}, std::nullopt);
  at::Tensor last = block.index_select(0, torch::tensor({1, 2}, torch::kLong)).contiguous();  // rows 0*2+1, 1*2+0
  linear.call(last, norm, view.norm_eps, {head}, Biases({head_bias}), "store", true, {logits});
  fed_expected.select(1, 0).copy_(logits.slice(1, 0, limit).argmax(1));
  step_loop(fed_expected, start + counts, kc4, vc4);
  EXPECT_TRUE(torch::equal(fed_tokens, fed_expected));
  EXPECT_TRUE(torch::equal(kc3, kc4));
  EXPECT_TRUE(torch::equal(vc3, vc4));
  // a count outside [1, W] and a feed without its counts: refused before anything is written
  const at::Tensor kc3_before = kc3.clone();
  const at::Tensor zero_count = torch::tensor({0, 1}, torch::kLong);
  EXPECT_THROW(call(fed_tokens, steps, model.weights, kc3, vc3, {rows, start, feed, zero_count}, false), c10::Error);
  EXPECT_THROW(call(fed_tokens, steps, model.weights, kc3, vc3, {rows, start, feed}, false), c10::Error);
  EXPECT_TRUE(torch::equal(kc3, kc3_before));
}

}  // namespace
