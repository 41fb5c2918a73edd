// IEEE half precision for the emulator: the storage type and the conversions the kernels use.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>

#include "cuda_emu.h"

struct __half {
  uint16_t __x;
};
struct __half2 {
  __half x, y;
};

inline float __half2float(__half h) {
  const uint32_t sign = uint32_t{h.__x & 0x8000u} << 16;
  const uint32_t exponent = (h.__x >> 10) & 0x1Fu;
  const uint32_t mantissa = h.__x & 0x3FFu;
  uint32_t bits;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in fp32
    bits = sign | std::bit_cast<uint32_t>(std::ldexp(static_cast<float>(mantissa), -24));
  } else if (exponent == 0x1F) {  // inf / NaN
    bits = sign | 0x7F800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  return std::bit_cast<float>(bits);
}

// Round to nearest even; overflow to inf, NaN kept (quiet).
inline __half __float2half(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  uint32_t magnitude = x & 0x7FFFFFFFu;
  if (magnitude >= 0x7F800000u) return {static_cast<uint16_t>(sign | 0x7C00u | (magnitude > 0x7F800000u ? 0x200u : 0u))};
  if (magnitude >= 0x477FF000u) return {static_cast<uint16_t>(sign | 0x7C00u)};  // >= 65520 rounds to inf
  if (magnitude < 0x38800000u) {  // below 2^-14: a subnormal half, mantissa = round(|f| * 2^24)
    const float scaled = std::bit_cast<float>(magnitude) * 16777216.0f;
    return {static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled)))};
  }
  magnitude -= 112u << 23;  // rebias the exponent
  magnitude += 0xFFFu + ((magnitude >> 13) & 1u);
  return {static_cast<uint16_t>(sign | (magnitude >> 13))};
}

inline __half __float2half_rn(float f) { return __float2half(f); }
inline float2 __half22float2(__half2 h) { return make_float2(__half2float(h.x), __half2float(h.y)); }
inline __half2 __floats2half2_rn(float a, float b) { return {__float2half(a), __float2half(b)}; }
