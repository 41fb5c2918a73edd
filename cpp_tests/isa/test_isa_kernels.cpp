// Every instruction-set path of the CPU forward kernels (csrc/cpu/simd) against a float64 reference and
// against itself (batch invariance, cached = streamed weights, the vector exp and SwiGLU = the scalar
// ones bit for bit; on amxbf16 the AMX route's row blocks, partial groups and cut ranges), without torch
// or GoogleTest: the same source runs natively under ctest (every x86
// path this CPU has) and cross-compiled for AArch64 under qemu-user (portable and NEON,
// tools/neon_kernel_tests.sh). Prints "N passed, N failed" and exits non-zero on a failure.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu/attention.h"
#include "cpu/fused_linear.h"
#include "cpu/isa.h"
#include "cpu/numeric.h"

using namespace specdec::cpu;

namespace {

int passed = 0, failed = 0;

void check(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
    return;
  }
  if (++failed <= 20) std::printf("FAILED: %s\n", what.c_str());
}

std::vector<Isa> paths() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512Bf16, Isa::kAmxBf16, Isa::kNeon})
    if (isa_supported(isa)) out.push_back(isa);
  return out;
}

uint32_t bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

bool same_bits(float a, float b) { return bits(a) == bits(b) || (std::isnan(a) && std::isnan(b)); }

// A weight of dtype type holding `exact` (the values after rounding to it).
struct Weight {
  DType type;
  int64_t rows, cols;
  std::vector<float> exact, f32;
  std::vector<uint16_t> half;

  Weight(DType t, int64_t n, int64_t k, std::mt19937& rng) : type(t), rows(n), cols(k), exact(n * k) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    if (t != DType::kF32) half.resize(n * k);
    else f32.resize(n * k);
    for (int64_t i = 0; i < n * k; ++i) {
      const float v = normal(rng);
      if (t == DType::kF32) f32[i] = exact[i] = v;
      if (t == DType::kBF16) half[i] = float_to_bf16(v), exact[i] = bf16_to_float(half[i]);
      if (t == DType::kF16) half[i] = float_to_fp16(v), exact[i] = fp16_to_float(half[i]);
    }
  }
  GemmWeight view() const {
    return {type == DType::kF32 ? static_cast<const void*>(f32.data()) : half.data(), type, rows, cols, cols};
  }
};

// fused_linear_range over the tiles [0, total) in ranges of `range` tiles (0: one range), as threads split
// them: out [M, N] = A W^T (optionally a SwiGLU of w and up).
std::vector<float> linear(Isa isa, const std::vector<float>& x, int64_t M, const Weight& w, bool bf16, bool cached,
                          const Weight* up = nullptr, int64_t range = 0) {
  const int64_t K = w.cols, N = w.rows;
  ActivationBuffers buffers;
  const GemmActivations a = prepare_gemm_activations(isa, x.data(), M, K, nullptr, 0.0f, bf16, cached, buffers);
  std::vector<float> out(M * N, 0.0f);
  std::vector<unsigned char> panels[2];
  GemmWeight ws[2] = {with_panels(isa, a, w.view(), panels[0]),
                      with_panels(isa, a, up != nullptr ? up->view() : w.view(), panels[1])};
  LinearOutput os[2] = {{out.data(), N, nullptr}, {out.data(), N, nullptr}};
  const LinearEpilogue mode = up != nullptr ? LinearEpilogue::kSwiGLU : LinearEpilogue::kStore;
  const int count = up != nullptr ? 2 : 1;
  const int64_t total = fused_linear_num_tiles(mode, ws, count), step = range > 0 ? range : total;
  for (int64_t begin = 0; begin < total; begin += step)
    fused_linear_range(isa, a, M, mode, ws, os, count, begin, std::min(total, begin + step), cached);
  return out;
}

// The path whose tiles a pass over cached weights takes: amxbf16's AMX route is for weights streamed
// from memory (simd/amx.h), its cached passes are avx512bf16's.
Isa cached_path(Isa isa) { return isa == Isa::kAmxBf16 ? Isa::kAvx512Bf16 : isa; }

void test_gemm(Isa isa) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::string name = isa_name(isa);
  struct Shape {
    int64_t N, K;
  };
  // (64 x 128, 16 x 1280, 40 x 96 and 80 x 64: AMX groups, 40 x 96 with a partial one; the rest avx512bf16's tiles)
  for (const Shape s : {Shape{37, 83}, Shape{64, 128}, Shape{5, 7}, Shape{16, 1280}, Shape{9, 33}, Shape{40, 96},
                        Shape{80, 64}}) {
    for (DType type : {DType::kF32, DType::kBF16, DType::kF16}) {
      const Weight w(type, s.N, s.K, rng), up(type, s.N, s.K, rng);
      std::vector<float> x(40 * s.K);
      for (float& v : x) v = normal(rng);
      for (bool bf16 : {false, true}) {
        if (bf16 && type != DType::kBF16) continue;
        const std::string where = name + " N=" + std::to_string(s.N) + " K=" + std::to_string(s.K) + " dtype=" +
                                  std::to_string(static_cast<int>(type)) + (bf16 ? " bf16 activations" : "");
        const std::vector<float> all = linear(isa, x, 16, w, bf16, false);
        // against float64, on the activations as the kernel multiplies them
        bool close = true;
        for (int64_t m = 0; m < 16 && close; ++m)
          for (int64_t n = 0; n < s.N; ++n) {
            double expected = 0.0, magnitude = 0.0;
            for (int64_t k = 0; k < s.K; ++k) {
              const float xa = bf16 ? round_to_bf16(x[m * s.K + k]) : x[m * s.K + k];
              expected += static_cast<double>(xa) * w.exact[n * s.K + k];
              magnitude += std::fabs(static_cast<double>(xa) * w.exact[n * s.K + k]);
            }
            if (std::fabs(all[m * s.N + n] - expected) > 4.0 * s.K * 1.2e-7 * magnitude + 1e-30) close = false;
          }
        check(close, where + ": out = A W^T within 4 K eps |A||W|");
        // batch invariance: every row block split (6, 4 + 3, 5 + 4 + 4, ...; AMX's 16 + 1, 16 + 16 + 8) gives
        // the 16-row pass's bits, and so do ranges of tiles that cut AMX's 16-feature groups
        for (int64_t M : {1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 17, 40}) {
          const std::vector<float> part(x.begin(), x.begin() + M * s.K);
          const std::vector<float> out = linear(isa, part, M, w, bf16, false);
          bool same = true;
          for (int64_t i = 0; i < std::min<int64_t>(M, 16) * s.N; ++i) same = same && same_bits(out[i], all[i]);
          for (int64_t m = 16; m < M && same; ++m) {  // the rows past 16 against a pass of the row alone
            const std::vector<float> row(x.begin() + m * s.K, x.begin() + (m + 1) * s.K);
            const std::vector<float> alone = linear(isa, row, 1, w, bf16, false);
            for (int64_t n = 0; n < s.N; ++n) same = same && same_bits(out[m * s.N + n], alone[n]);
          }
          check(same, where + " M=" + std::to_string(M) + ": the rows of the 16-row pass (later rows: alone), bit for bit");
        }
        for (int64_t range : {1, 3, 5}) {
          const std::vector<float> out = linear(isa, x, 16, w, bf16, false, nullptr, range);
          bool same = true;
          for (int64_t i = 0; i < 16 * s.N; ++i) same = same && same_bits(out[i], all[i]);
          check(same, where + " ranges of " + std::to_string(range) + " tiles: the one range's bits");
        }
        // a one-row pass over cached weights (wide tiles) = streamed (on the path cached passes take)
        const std::vector<float> one(x.begin(), x.begin() + s.K);
        const std::vector<float> cached = linear(isa, one, 1, w, bf16, true);
        const std::vector<float> streamed =
            cached_path(isa) == isa ? all : linear(cached_path(isa), x, 16, w, bf16, false);
        bool same = true;
        for (int64_t n = 0; n < s.N; ++n) same = same && same_bits(cached[n], streamed[n]);
        check(same, where + ": cached weights give the streamed bits of " + isa_name(cached_path(isa)));
        const std::vector<float> gated = linear(isa, one, 1, w, bf16, true, &up);
        const std::vector<float> gated_many = linear(cached_path(isa), x, 3, w, bf16, false, &up);
        same = true;
        for (int64_t n = 0; n < s.N; ++n) same = same && same_bits(gated[n], gated_many[n]);
        check(same, where + ": SwiGLU, one cached row = a row of a streamed pass");
        const std::vector<float> gated_16 = linear(isa, x, 16, w, bf16, false, &up);
        const std::vector<float> gated_40 = linear(isa, x, 40, w, bf16, false, &up, 3);
        same = true;
        for (int64_t i = 0; i < 16 * s.N; ++i) same = same && same_bits(gated_16[i], gated_40[i]);
        check(same, where + ": SwiGLU, a 40-row pass in ranges of 3 tiles = the 16-row pass");
      }
    }
  }
}

// out [B, T, H, D] by a float64 softmax(q K^T * scale) V over the visible keys.
std::vector<double> attention_reference(const AttentionProblem& p, const std::vector<float>& k,
                                        const std::vector<float>& v) {
  const int64_t B = p.batch, T = p.tokens, H = p.heads, D = p.head_dim;
  std::vector<double> out(B * T * H * D, 0.0);
  std::vector<int64_t> keys(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = h / (H / p.kv_heads), start = p.start[b];
        const int64_t n = attention_keys(p, b, t, keys.data());
        std::vector<double> score(n);
        double top = -INFINITY, total = 0.0;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t slot = i < start ? i : keys[i - start];
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d)
            dot += static_cast<double>(p.q[((b * T + t) * H + h) * D + d]) * k[((b * p.kv_heads + g) * p.capacity + slot) * D + d];
          score[i] = dot * p.scale;
          top = std::max(top, score[i]);
        }
        for (double& s : score) total += (s = std::exp(s - top));
        for (int64_t i = 0; i < n; ++i) {
          const int64_t slot = i < start ? i : keys[i - start];
          for (int64_t d = 0; d < D; ++d)
            out[((b * T + t) * H + h) * D + d] += score[i] / total * v[((b * p.kv_heads + g) * p.capacity + slot) * D + d];
        }
      }
  return out;
}

std::vector<float> attend(Isa isa, AttentionProblem p) {
  std::vector<float> out(p.batch * p.tokens * p.heads * p.head_dim);
  p.out = out.data();
  int64_t longest = 0;
  for (int64_t b = 0; b < p.batch; ++b) longest = std::max(longest, p.start[b]);
  std::vector<float> scratch(attention_scratch_floats(longest, p.tokens));
  std::vector<int64_t> keys(attention_scratch_keys(p.tokens));
  cache_attention_range(isa, p, 0, attention_num_tasks(p), scratch.data(), keys.data());
  return out;
}

void test_attention(Isa isa) {
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t B = 2, H = 4, Hk = 2, capacity = 80;
  for (int64_t D : {16, 18, 64, 100}) {
    for (DType type : {DType::kF32, DType::kBF16, DType::kF16}) {
      std::vector<float> k(B * Hk * capacity * D), v(k.size());
      std::vector<uint16_t> k16(k.size()), v16(k.size());
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = normal(rng), v[i] = normal(rng);
        if (type == DType::kBF16) k16[i] = float_to_bf16(k[i]), v16[i] = float_to_bf16(v[i]);
        if (type == DType::kF16) k16[i] = float_to_fp16(k[i]), v16[i] = float_to_fp16(v[i]);
        if (type != DType::kF32)
          k[i] = load_as_float(type, k16.data(), i), v[i] = load_as_float(type, v16.data(), i);
      }
      const void* kc = type == DType::kF32 ? static_cast<const void*>(k.data()) : k16.data();
      const void* vc = type == DType::kF32 ? static_cast<const void*>(v.data()) : v16.data();
      for (int64_t T : {1, 3, 6}) {
        for (bool tree : {false, true}) {
          std::vector<float> q(B * T * H * D);
          for (float& x : q) x = normal(rng);
          const std::vector<int64_t> start = {37, 5};
          std::vector<uint8_t> visible(B * T * T, 0);
          for (int64_t b = 0; b < B; ++b)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t j = 0; j <= t; ++j) visible[(b * T + t) * T + j] = (j == 0 || j == t || (j + b) % 2 == 0);
          const AttentionProblem p{q.data(), kc, vc, type, start.data(), tree ? visible.data() : nullptr, B, T, H, Hk,
                                   D, capacity, 1.0f / std::sqrt(static_cast<float>(D)), nullptr};
          const std::vector<float> out = attend(isa, p);
          const std::vector<double> expected = attention_reference(p, k, v);
          bool close = true;
          for (size_t i = 0; i < out.size(); ++i) close = close && std::fabs(out[i] - expected[i]) < 2e-5;
          const std::string where = std::string(isa_name(isa)) + " D=" + std::to_string(D) + " T=" + std::to_string(T) +
                                    " dtype=" + std::to_string(static_cast<int>(type)) + (tree ? " tree" : " chain");
          check(close, where + ": within 2e-5 of float64");
          if (tree) continue;
          // a block's query t = the same query alone once the tokens before it are the prefix
          bool same = true;
          for (int64_t t = 0; t < T; ++t) {
            std::vector<float> q1(B * H * D);
            for (int64_t b = 0; b < B; ++b)
              std::copy_n(q.data() + (b * T + t) * H * D, H * D, q1.data() + b * H * D);
            const std::vector<int64_t> start1 = {start[0] + t, start[1] + t};
            const AttentionProblem p1{q1.data(), kc, vc, type, start1.data(), nullptr, B, 1, H, Hk, D, capacity,
                                      p.scale, nullptr};
            const std::vector<float> alone = attend(isa, p1);
            for (int64_t b = 0; b < B; ++b)
              for (int64_t i = 0; i < H * D; ++i) same = same && same_bits(alone[b * H * D + i], out[(b * T + t) * H * D + i]);
          }
          check(same, where + ": each query of the block = the query alone, bit for bit");
        }
      }
    }
  }
}

std::vector<float> special_values() {
  const float inf = INFINITY;
  std::vector<float> values = {0.0f, -0.0f, 1.0f, -1.0f, 87.0f, -87.0f, 87.5f, -87.5f, 88.0f, -88.0f, 100.0f, -100.0f,
                               1e-30f, -1e-30f, 1e-45f, -1e-45f, inf, -inf, NAN, 3.4e38f, -3.4e38f};
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0.0f, 6.0f);
  for (int i = 0; i < 4000; ++i) values.push_back(normal(rng));
  while (values.size() % 4 != 0) values.push_back(0.5f);
  return values;
}

void test_swiglu_lanes() {
  const std::vector<float> values = special_values();
  bool same = true;
  for (size_t i = 0; i < values.size(); i += 4) {
    const float u[4] = {0.75f, 0.25f, -0.25f, -0.75f};
    const float bias[4] = {0.0f, 0.5f, -0.5f, 1.0f};
    float lanes[4], biased[4];
    swiglu4(&values[i], nullptr, u, nullptr, lanes);
    swiglu4(&values[i], bias, u, bias, biased);
    for (int j = 0; j < 4; ++j) {
      same = same && same_bits(lanes[j], silu(values[i + j] + 0.0f) * (u[j] + 0.0f));
      same = same && same_bits(biased[j], silu(values[i + j] + bias[j]) * (u[j] + bias[j]));
    }
  }
  check(same, "swiglu4: the scalar silu(g) * u bit for bit, special values included");
}

// A path's vector exp (through its softmax: scores -> exp(score - max)) = the scalar exp_nonpositive.
void test_softmax_exp(Isa isa) {
  std::vector<float> values = special_values();
  for (float& x : values) x = std::isnan(x) || std::isinf(x) ? -1.0f : x;  // one finite row
  float top = values[0];
  for (float x : values) top = x > top ? x : top;
  const int64_t n = static_cast<int64_t>(values.size()) - 3;  // a partial last vector
  // one key per value: q = 1, K[i] = values[i] in fp32, D = 1, scale 1, no block tokens past the prefix
  std::vector<float> k(values.begin(), values.begin() + n + 1), v(n + 1, 0.0f);
  v[0] = 1.0f;
  const float q = 1.0f;
  const int64_t start = n;
  std::vector<float> out(1);
  AttentionProblem p{&q, k.data(), v.data(), DType::kF32, &start, nullptr, 1, 1, 1, 1, 1, n + 1, 1.0f, out.data()};
  std::vector<float> scratch(attention_scratch_floats(n, 1));
  std::vector<int64_t> keys(attention_scratch_keys(1));
  cache_attention_range(isa, p, 0, 1, scratch.data(), keys.data());
  float row_top = -INFINITY;
  for (int64_t i = 0; i <= n; ++i) row_top = values[i] > row_top ? values[i] : row_top;
  bool same = true;
  for (int64_t i = 0; i <= n; ++i) same = same && same_bits(scratch[i], exp_nonpositive(values[i] - row_top));
  check(same, std::string(isa_name(isa)) + ": the softmax's vector exp = exp_nonpositive bit for bit");
}

}  // namespace

int main() {
  for (Isa isa : paths()) {
    std::printf("path %s\n", isa_name(isa));
    test_gemm(isa);
    test_attention(isa);
    test_softmax_exp(isa);
  }
  test_swiglu_lanes();
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
