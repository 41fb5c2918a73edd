// The portable path (any CPU: plain C++ loops that the compiler vectorises for the build's baseline):
// its vector traits (the contract: paths.h) and the kernels compiled for them.
#include <cstdint>

#include "kernel_common.h"
#include "paths.h"

namespace specdec::cpu::portable {

struct Vec {
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;  // (arrays: the compiler's to place)
  struct F {
    float v[kLanes];
  };
  using Mask = int;
  struct Cmp {
    bool v[kLanes];
  };

  static constexpr PathTuning kTuning{.panel_rows = 4, .block_panels = {4, 2, 1, 1}, .value_chunks = 1};
  static constexpr bool kHasBf16Dot = false;
  template <DType>
  using Bf16Dot = void;

  template <typename Fn>
  static F each(Fn&& fn) {
    F r;
    for (int l = 0; l < kLanes; ++l) r.v[l] = fn(l);
    return r;
  }
  static F zero() { return set1(0.0f); }
  static F set1(float x) { return each([&](int) { return x; }); }
  static Mask mask(int64_t valid) { return valid >= kLanes ? kLanes : valid <= 0 ? 0 : static_cast<int>(valid); }
  static F load(const float* p) { return each([&](int l) { return p[l]; }); }
  static F load(const float* p, Mask m) { return each([&](int l) { return l < m ? p[l] : 0.0f; }); }
  template <DType kT>
  static F load_widen(const void* base, int64_t i, Mask m = kLanes) {
    return each([&](int l) { return l < m ? load_as_float<kT>(base, i + l) : 0.0f; });
  }
  static void load_bf16_pairs(const uint16_t* p, F& first, F& second) {
    first = each([&](int l) { return bf16_to_float(p[2 * l]); });
    second = each([&](int l) { return bf16_to_float(p[2 * l + 1]); });
  }
  static void store(float* p, F x, Mask m = kLanes) {
    for (int l = 0; l < m; ++l) p[l] = x.v[l];
  }
  static F first(F x, Mask m) { return each([&](int l) { return l < m ? x.v[l] : 0.0f; }); }

  static F add(F a, F b) { return each([&](int l) { return a.v[l] + b.v[l]; }); }
  static F sub(F a, F b) { return each([&](int l) { return a.v[l] - b.v[l]; }); }
  static F mul(F a, F b) { return each([&](int l) { return a.v[l] * b.v[l]; }); }
  static F div(F a, F b) { return each([&](int l) { return a.v[l] / b.v[l]; }); }
  static F max(F a, F b) { return each([&](int l) { return a.v[l] > b.v[l] ? a.v[l] : b.v[l]; }); }
  // Multiply then add, two roundings: the build's baseline may have no fused multiply-add.
  static F fma(F a, F b, F c) { return each([&](int l) { return c.v[l] + a.v[l] * b.v[l]; }); }
  static Cmp greater_equal(F a, F b) {
    Cmp c;
    for (int l = 0; l < kLanes; ++l) c.v[l] = a.v[l] >= b.v[l];
    return c;
  }
  static F select(Cmp c, F a, F b) { return each([&](int l) { return c.v[l] ? a.v[l] : b.v[l]; }); }
  static F pow2(F n) {
    return each([&](int l) { return bits_to_float(static_cast<uint32_t>(static_cast<int32_t>(n.v[l]) + 127) << 23); });
  }

  static float sum(F x) { return fold_sum<kLanes>(x.v); }
  static void reduce4(F a0, F a1, F a2, F a3, float* out) {
    out[0] = sum(a0), out[1] = sum(a1), out[2] = sum(a2), out[3] = sum(a3);
  }
  static float reduce_max(F x) {
    float top = x.v[0];
    for (int l = 1; l < kLanes; ++l) top = x.v[l] > top ? x.v[l] : top;
    return top;
  }
};

#define SPECDEC_UNROLL
#include "vec_math.inc"
#include "gemm_impl.inc"
#include "attention_impl.inc"
#undef SPECDEC_UNROLL

}  // namespace specdec::cpu::portable
