// The ARM NEON path (AArch64: Apple silicon, Graviton, Ampere; NEON is part of the baseline there, so
// no target region): its vector traits, its tuning, and the kernels (gemm_impl.inc,
// attention_impl.inc) compiled for it. The traits' contract is in paths.h. 4 fp32 lanes in 32
// registers; bf16 widened by a shift, fp16 by FCVTL; partial vectors through a zero-filled buffer.
// Tested under qemu-user (tools/neon_kernel_tests.sh); its tuning is not yet measured on an ARM machine.
#include <cstdint>

#include "kernel_common.h"
#include "paths.h"

#if SPECDEC_HAVE_NEON_PATH
#include <arm_neon.h>

namespace specdec::cpu::neon {

#include "vec_arith.inc"

struct NeonOps : VectorArith<4> {
  // Not yet measured on an ARM machine: AVX-512's register budget, which NEON's 32 registers share
  // (6 rows x 4 panels of 4 features: 24 accumulators, 4 weight vectors and an activation, 29 of 32; with
  // bf16 weights widened in pairs a 6-row block computes 2 panels at a time: gemm_impl.inc, block_panels).
  static constexpr PathTuning kTuning{.panel_rows = 6, .block_panels = {8, 8, 4, 4, 4, 4}, .value_chunks = 4};

  static constexpr int kRegisters = 32;
  static F load(const float* p) { return vld1q_f32(p); }
  // kLanes 16-bit floats, widened to fp32: bf16 by a shift, fp16 by FCVTL.
  template <DType kT>
  static F load_half(const uint16_t* p) {
    if constexpr (kT == DType::kBF16) return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  static void store(float* p, F v) { vst1q_f32(p, v); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }

  // The sums of four vectors' 4 lanes into out[0..3], each associated as fold_sum<4>: (l0 + l2) + (l1 + l3).
  static void reduce4(F a0, F a1, F a2, F a3, float* out) {
    const F h01 = vcombine_f32(vadd_f32(vget_low_f32(a0), vget_high_f32(a0)), vadd_f32(vget_low_f32(a1), vget_high_f32(a1)));
    const F h23 = vcombine_f32(vadd_f32(vget_low_f32(a2), vget_high_f32(a2)), vadd_f32(vget_low_f32(a3), vget_high_f32(a3)));
    vst1q_f32(out, vpaddq_f32(h01, h23));
  }

};
using Vec = WithBufferedTails<NeonOps>;

#define SPECDEC_UNROLL _Pragma("GCC unroll 16")
#include "vec_math.inc"
#include "gemm_impl.inc"
#include "attention_impl.inc"
#undef SPECDEC_UNROLL

}  // namespace specdec::cpu::neon
#endif
