// The AVX2 path (AVX2 + FMA + F16C: most x86 CPUs of the last decade without AVX-512): its vector
// traits, its tuning, and the kernels (gemm_impl.inc, attention_impl.inc) compiled for it. The traits'
// contract is in paths.h. 8 fp32 lanes in 16 ymm registers; bf16 widened by a shift, fp16 by
// F16C; partial vectors through a zero-filled buffer (AVX2 has no masked 16-bit load).
#include <cstdint>

#include "kernel_common.h"
#include "paths.h"

#if SPECDEC_HAVE_X86_PATHS
#include <immintrin.h>

SPECDEC_BEGIN_TARGET_AVX2
namespace specdec::cpu::avx2 {

#include "vec_arith.inc"

struct Avx2Ops : VectorArith<8> {
  // 2 rows x 4 panels of 8 features: 8 accumulators, the two rows' activation pairs and one panel's
  // widened pair in the 16 registers; one row 8 panels. 4 rows x 2 panels (the same 8 accumulators with
  // the panels' 4 weight vectors live) spilled a register every k step and ran at 80% of this on a Zen 5
  // (BENCHMARKS.md, "AVX2's row blocks"); the pair layout against one k per step, on a Zen 1: "Panels".
  // Attention's weighted values: 16 dimensions x 4 queries in 8 registers.
  static constexpr PathTuning kTuning{.panel_rows = 2, .block_panels = {8, 4}, .value_chunks = 2};

  static constexpr int kRegisters = 16;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  // kLanes 16-bit floats, widened to fp32: bf16 by a shift, fp16 by F16C.
  template <DType kT>
  static F load_half(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (kT == DType::kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
  }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

  // The sums of four vectors' 8 lanes into out[0..3], each associated exactly as fold_sum<8> (lane l +=
  // lane l + 4, then + 2, + 1), four at a time.
  static void reduce4(F a0, F a1, F a2, F a3, float* out) {
    const F u01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
    const F u23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
    // low 128 bits: vectors 0 and 2 after the + 2 level (2 lanes each); high: 1 and 3
    const F v = _mm256_add_ps(_mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(u01, u23, _MM_SHUFFLE(3, 2, 3, 2)));
    const F w = _mm256_add_ps(v, _mm256_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
    _mm_storeu_ps(out, _mm256_castps256_ps128(_mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 2, 6, 0, 0, 0, 0))));
  }
};
using Vec = WithBufferedTails<Avx2Ops>;

#define SPECDEC_UNROLL _Pragma("GCC unroll 16")
#include "vec_math.inc"
#include "gemm_impl.inc"
#include "attention_impl.inc"
#undef SPECDEC_UNROLL

}  // namespace specdec::cpu::avx2
SPECDEC_END_TARGET
#endif
