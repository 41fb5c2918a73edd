// bfloat16 for the emulator: the storage type and the conversions the kernels use.
#pragma once
#include <bit>
#include <cstdint>

#include "cuda_emu.h"

struct __nv_bfloat16 {
  uint16_t __x;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline float __bfloat162float(__nv_bfloat16 b) { return std::bit_cast<float>(uint32_t{b.__x} << 16); }

// Round to nearest even; NaN kept (quiet).
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return {static_cast<uint16_t>((x >> 16) | 0x40u)};
  x += 0x7FFFu + ((x >> 16) & 1u);
  return {static_cast<uint16_t>(x >> 16)};
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
inline float2 __bfloat1622float2(__nv_bfloat162 b) {
  return make_float2(__bfloat162float(b.x), __bfloat162float(b.y));
}
