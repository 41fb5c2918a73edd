// Scalar conversions between fp32 and the 16-bit float formats of weights and caches, without torch:
// bf16 and fp16 widen exactly; narrowing rounds to nearest even, as torch's .to() does.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace specdec::cpu {

enum class DType { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// f rounded to the nearest bf16, as an fp32 (what a bf16 activation holds).
inline float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Subnormal (or zero): mantissa * 2^-24 is exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign ? -magnitude : magnitude;
}

inline uint16_t float_to_fp16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf (>= 65520)
  if (abs < 0x38800000u) {
    // Below the smallest normal fp16 (2^-14): a multiple of 2^-24, rounded to nearest even by the
    // fp32 addition (0.5 is exactly representable next to the integer part at this magnitude).
    const float scaled = bits_to_float(abs) * 16777216.0f;  // * 2^24, exact
    const float rounded = (scaled + 8388608.0f) - 8388608.0f;  // RNE to an integer (< 2^23)
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(rounded));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  const uint32_t rebased = abs - (112u << 23);
  const uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rounded >> 13));
}

template <DType kType>
inline float load_as_float(const void* base, int64_t i) {
  if constexpr (kType == DType::kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (kType == DType::kBF16) {
    return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
  } else {
    return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

template <DType kType>
inline void store_from_float(void* base, int64_t i, float value) {
  if constexpr (kType == DType::kF32) {
    static_cast<float*>(base)[i] = value;
  } else if constexpr (kType == DType::kBF16) {
    static_cast<uint16_t*>(base)[i] = float_to_bf16(value);
  } else {
    static_cast<uint16_t*>(base)[i] = float_to_fp16(value);
  }
}

inline float load_as_float(DType type, const void* base, int64_t i) {
  switch (type) {
    case DType::kBF16:
      return load_as_float<DType::kBF16>(base, i);
    case DType::kF16:
      return load_as_float<DType::kF16>(base, i);
    default:
      return load_as_float<DType::kF32>(base, i);
  }
}

// fn(std::integral_constant<DType, type>{}) for a run-time dtype: the kernels are templates on the
// dtype of their weights or cache, chosen once per call.
template <typename Fn>
inline void with_dtype(DType type, Fn&& fn) {
  switch (type) {
    case DType::kBF16:
      return fn(std::integral_constant<DType, DType::kBF16>{});
    case DType::kF16:
      return fn(std::integral_constant<DType, DType::kF16>{});
    default:
      return fn(std::integral_constant<DType, DType::kF32>{});
  }
}

}  // namespace specdec::cpu
