// Row-wise float helpers for the CPU kernels, written as plain loops that the compiler vectorises
// (no libm calls inside the loops).
#pragma once
#include <cstdint>
#include <cstring>

namespace specdec::cpu {

// exp(x) for x <= 0 with about 2 ulp error (Cody-Waite reduction, degree-6 polynomial);
// exactly 0 below the smallest normal result, so masked (-inf) logits get zero weight.
inline float exp_nonpositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kMinArg = -87.3f;
  const bool underflow = !(x >= kMinArg);  // also true for NaN and -inf
  const float xc = underflow ? 0.0f : x;
  const float n = __builtin_floorf(xc * kLog2e + 0.5f);
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float poly = 1.9875691500e-4f;
  poly = poly * r + 1.3981999507e-3f;
  poly = poly * r + 8.3334519073e-3f;
  poly = poly * r + 4.1665795894e-2f;
  poly = poly * r + 1.6666665459e-1f;
  poly = poly * r + 5.0000001201e-1f;
  const float expm = (poly * r * r + r) + 1.0f;
  const int32_t exponent_bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &exponent_bits, sizeof(scale));
  return underflow ? 0.0f : expm * scale;
}

}  // namespace specdec::cpu
