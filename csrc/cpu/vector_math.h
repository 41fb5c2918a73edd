// Row-wise float loops of the CPU kernels. Each keeps kLanes independent accumulators, so the
// compiler vectorises it without reassociating floating point (no -ffast-math), and is compiled
// twice (x86-64-v3, i.e. AVX2 + FMA, and baseline x86-64) with the best picked at load time.
// Selects in these loops vectorise only with -fno-trapping-math (setup.py and CMakeLists.txt).
#pragma once
#include <cstdint>
#include <cstring>

#include "../common/sampling_math.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SPECDEC_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SPECDEC_CPU_CLONES
#endif

namespace specdec::cpu {

constexpr int kLanes = 16;

// The constants of exp_nonpositive, shared with its vector form (simd/vec_math.inc), which performs the
// same operations in the same order so that each lane gives this function's bits.
constexpr float kExpLog2e = 1.44269504088896341f;
constexpr float kExpLn2Hi = 0.693359375f;
constexpr float kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpMinArg = -87.3f;
constexpr float kExpRoundMagic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp(x) for x <= 0 with about 2 ulp error (Cody-Waite reduction, degree-6 polynomial);
// exactly 0 below the smallest normal result, so masked (-inf) logits get zero weight, and 0 for
// NaN (a -inf logit at T = +inf scales to -inf * 0; sampling_math.h). Branch-free (selects and a
// round-to-nearest by the 1.5 * 2^23 trick) so that loops over it vectorise.
inline float exp_nonpositive(float x) {
  const float xc = x >= kExpMinArg ? x : kExpMinArg;  // NaN -> kExpMinArg: no NaN to int conversion below
  const float n = (xc * kExpLog2e + kExpRoundMagic) - kExpRoundMagic;
  const float r = (xc - n * kExpLn2Hi) - n * kExpLn2Lo;
  float poly = kExpPoly[0];
  for (int i = 1; i < 6; ++i) poly = poly * r + kExpPoly[i];
  const float expm = (poly * r * r + r) + 1.0f;
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent_bits, sizeof(scale));
  const float result = expm * scale;
  return x >= kExpMinArg ? result : 0.0f;
}

// silu(g) = g * sigmoid(g), sigmoid through exp(-|g|) <= 1 so that nothing overflows.
inline float silu(float g) {
  const float e = exp_nonpositive(g >= 0.0f ? -g : g);
  const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return g * sigmoid;
}

inline float lane_sum(const float (&lanes)[kLanes]) {
  float total = 0.0f;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

struct RowMax {
  float max;
  bool has_nan;
};

// Largest value of x[0, n) and whether any is NaN.
SPECDEC_CPU_CLONES inline RowMax row_max(const float* x, int64_t n) {
  float m[kLanes];
  int32_t nan[kLanes];
  for (int l = 0; l < kLanes; ++l) m[l] = -__builtin_inff(), nan[l] = 0;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = x[j + l];
      m[l] = v > m[l] ? v : m[l];
      nan[l] |= v != v;
    }
  }
  for (; j < n; ++j) {
    m[0] = x[j] > m[0] ? x[j] : m[0];
    nan[0] |= x[j] != x[j];
  }
  RowMax result{m[0], nan[0] != 0};
  for (int l = 1; l < kLanes; ++l) {
    result.max = m[l] > result.max ? m[l] : result.max;
    result.has_nan = result.has_nan || nan[l] != 0;
  }
  return result;
}

// sum_j exp((x[j] - shift) * scale) for (x - shift) * scale <= 0 (sampling_math.h's weight_exponent: a finite
// x's term is 1 at scale 0 even where x - shift overflows), each term also written to out
// when kStore.
template <bool kStore>
SPECDEC_CPU_CLONES inline float exp_sum_impl(const float* x, int64_t n, float shift, float scale, float* out) {
  float s[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float e = exp_nonpositive(weight_exponent(x[j + l], shift, scale));
      s[l] += e;
      if constexpr (kStore) out[j + l] = e;
    }
  }
  for (; j < n; ++j) {
    const float e = exp_nonpositive(weight_exponent(x[j], shift, scale));
    s[0] += e;
    if constexpr (kStore) out[j] = e;
  }
  return lane_sum(s);
}

inline float exp_sum(const float* x, int64_t n, float shift, float scale, float* out) {
  return out ? exp_sum_impl<true>(x, n, shift, scale, out) : exp_sum_impl<false>(x, n, shift, scale, nullptr);
}

// The residual r_j = max(0, w_j * inv_mass - q_j): its sum, and whether q is a distribution (every q_j
// in [0, 1], their sum within kProbabilitySumTolerance of 1). Written over w when `write` is set.
struct ResidualSum {
  float mass;
  bool q_valid;
};

template <bool kWrite>
SPECDEC_CPU_CLONES inline ResidualSum residual_pass_impl(float* w, float inv_mass, const float* q, int64_t n) {
  float s[kLanes] = {};
  float q_sum[kLanes] = {};
  int32_t bad[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float qv = q[j + l];
      bad[l] |= !(qv >= 0.0f && qv <= 1.0f);
      q_sum[l] += qv;
      const float r = w[j + l] * inv_mass - qv;
      const float rp = r > 0.0f ? r : 0.0f;
      s[l] += rp;
      if constexpr (kWrite) w[j + l] = rp;
    }
  }
  for (; j < n; ++j) {
    bad[0] |= !(q[j] >= 0.0f && q[j] <= 1.0f);
    q_sum[0] += q[j];
    const float r = w[j] * inv_mass - q[j];
    const float rp = r > 0.0f ? r : 0.0f;
    s[0] += rp;
    if constexpr (kWrite) w[j] = rp;
  }
  bool q_valid = true;
  for (int l = 0; l < kLanes; ++l) q_valid = q_valid && bad[l] == 0;
  const float total = lane_sum(q_sum);
  q_valid = q_valid && total >= 1.0f - kProbabilitySumTolerance && total <= 1.0f + kProbabilitySumTolerance;
  return {lane_sum(s), q_valid};
}

inline ResidualSum residual_pass(float* w, float inv_mass, const float* q, int64_t n, bool write) {
  return write ? residual_pass_impl<true>(w, inv_mass, q, n) : residual_pass_impl<false>(w, inv_mass, q, n);
}

SPECDEC_CPU_CLONES inline float row_sum(const float* w, int64_t n) {
  float s[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) s[l] += w[j + l];
  }
  for (; j < n; ++j) s[0] += w[j];
  return lane_sum(s);
}

// Inverse CDF over non-negative weights: the smallest index whose running sum exceeds target;
// the last index with positive weight if rounding leaves the running sum at or below it.
inline int64_t inverse_cdf(const float* w, int64_t n, float target) {
  constexpr int64_t kChunk = 1024;  // whole chunks are skipped by their vectorised sums
  float running = 0.0f;
  int64_t last_positive = 0;
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t end = begin + kChunk < n ? begin + kChunk : n;
    const float chunk = row_sum(w + begin, end - begin);
    if (chunk <= 0.0f) continue;
    if (running + chunk <= target) {
      running += chunk;
      for (int64_t j = end - 1; j >= begin; --j) {
        if (w[j] > 0.0f) {
          last_positive = j;
          break;
        }
      }
      continue;
    }
    for (int64_t j = begin; j < end; ++j) {
      if (w[j] > 0.0f) {
        running += w[j];
        last_positive = j;
        if (running > target) return j;
      }
    }
  }
  return last_positive;
}

}  // namespace specdec::cpu
