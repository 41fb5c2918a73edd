// The AVX-512 path (AVX512F/BW/VL/DQ + AVX512-BF16): its vector traits, its tuning, and the kernels
// (gemm_impl.inc, attention_impl.inc) compiled for it. The traits' contract is in paths.h.
#include <cstdint>

#include "kernel_common.h"
#include "paths.h"

#if SPECDEC_HAVE_X86_PATHS
#include <immintrin.h>

SPECDEC_BEGIN_TARGET_AVX512BF16
namespace specdec::cpu::avx512 {

// GCC 12's AVX-512 intrinsics start some results from _mm512_undefined_*() (GCC bug 105593), which
// -Wmaybe-uninitialized reports once they are inlined; the values are fully written.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "vec_arith.inc"

struct Vec : VectorArith<16> {
  using F = __m512;
  using Mask = __mmask16;

  // 6 rows x 4 panels of 16 features (a group): 24 accumulators, 4 weight vectors and an activation
  // broadcast, 29 of 32 registers. Against the former row-major tiles on a Zen 4, one thread
  // (BENCHMARKS.md, "Panels"): the draft's 128-token prefill 1.6x, the target's 150-token prefill 1.4x, the
  // target's projections 1.1-1.3x at 5-16 rows, within noise at 1-3. Attention's weighted values: 64
  // dimensions at a time.
  static constexpr PathTuning kTuning{.panel_rows = 6, .block_panels = {4, 4, 4, 4, 4, 4}, .value_chunks = 4};
  static constexpr int kRegisters = 32;
  static constexpr bool kHasBf16Dot = true;  // (Bf16Dot below)

  static Mask mask(int64_t valid) {
    return valid >= 16 ? static_cast<Mask>(0xffff) : valid <= 0 ? static_cast<Mask>(0) : static_cast<Mask>((1u << valid) - 1u);
  }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  template <DType kT>
  static F load_widen(const void* base, int64_t i, Mask m = 0xffff) {
    if constexpr (kT == DType::kF32) {
      return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + i);
    } else {
      // The zero-masking forms: GCC 12's unmasked ones warn about their own undefined pass-through.
      const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i);
      if constexpr (kT == DType::kBF16) {
        return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16));
      } else {
        return _mm512_maskz_cvtph_ps(0xffff, h);
      }
    }
  }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static void store(float* p, F v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }
  static F first(F v, Mask m) { return _mm512_maskz_mov_ps(m, v); }

  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

  // The sums of four vectors' 16 lanes into out[0..3], each associated exactly as fold_sum<16> (lane l
  // += lane l + 8, then + 4, + 2, + 1), four at a time: a tenth of the instructions of four scalar
  // folds. __builtin_shufflevector: GCC 12's shuffle intrinsics warn about their undefined operands.
  static void reduce4(F a0, F a1, F a2, F a3, float* out) {
    const F u01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const F u23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    // 4-lane block j of x: vector j after the + 4 level
    const F x = __builtin_shufflevector(u01, u23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(u01, u23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const F y = x + __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const F z = y + __builtin_shufflevector(y, y, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    _mm_storeu_ps(out, __builtin_shufflevector(z, z, 0, 4, 8, 12));
  }


  // bf16 x bf16 (bf16 weights, activations given as bf16): VDPBF16PS, 32 products per instruction (a
  // pair of k for each of 16 features), exact, accumulated in fp32.
  template <DType>
  struct Bf16Dot {
    static constexpr int kPair = 2;
    static constexpr int kWeightBytes = 2;
    static constexpr int kVectors = 1;  // vectors per A and per W
    using A = __m512bh;
    using W = __m512bh;
    static const void* activations(const GemmActivations& a, int64_t m) { return a.bf16 + m * a.ld_bf16; }
    // The pair of activations of step s in every lane (their 32 bits: the k-th in the low half).
    static A broadcast(const void* x, int64_t s) {
      int32_t pair;
      std::memcpy(&pair, static_cast<const uint16_t*>(x) + 2 * s, sizeof(pair));
      return (A)_mm512_set1_epi32(pair);
    }
    // ... of the last step of an odd K: its one activation and a zero (nothing is read past K).
    static A broadcast_last(const void* x, int64_t s, int64_t) {
      return (A)_mm512_set1_epi32(static_cast<int32_t>(static_cast<const uint16_t*>(x)[2 * s]));
    }
    static W panel(const void* p, int64_t s) { return (W)_mm512_loadu_si512(static_cast<const uint16_t*>(p) + 32 * s); }
    static F madd(F acc, A a, W w) { return _mm512_dpbf16_ps(acc, a, w); }
  };
};

// Fully unrolled loops over register arrays: an index left at run time keeps an array in memory, and
// the accumulators then go through the stack.
#define SPECDEC_UNROLL _Pragma("GCC unroll 16")
#include "vec_math.inc"
#include "gemm_impl.inc"
#include "attention_impl.inc"
#undef SPECDEC_UNROLL

#pragma GCC diagnostic pop

}  // namespace specdec::cpu::avx512
SPECDEC_END_TARGET
#endif
