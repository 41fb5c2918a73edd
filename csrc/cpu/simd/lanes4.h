// SwiGLU over a tile's four outputs (kTileN) in the GEMM epilogue, which runs in baseline code on every
// path: four SSE2 lanes on x86-64, NEON on AArch64, scalar elsewhere. Bit for bit the scalar
// silu(g) * u: the scalar epilogue did not vectorise and took a tenth of a verification pass (perf, 9 rows).
#pragma once
#include <cstdint>

#include "kernel_common.h"

#if SPECDEC_HAVE_X86_PATHS
#include <emmintrin.h>

namespace specdec::cpu::lanes4 {

#include "vec_arith.inc"

// The part of the vector traits (paths.h) that vec_math.inc uses, in SSE2.
struct Vec : VectorArith<4> {
  using F = __m128;
  static F load(const float* p) { return _mm_loadu_ps(p); }
  static void store(float* p, F v) { _mm_storeu_ps(p, v); }
};
#include "vec_math.inc"

}  // namespace specdec::cpu::lanes4
#define SPECDEC_HAVE_LANES4 1
#elif SPECDEC_HAVE_NEON_PATH
#include <arm_neon.h>

namespace specdec::cpu::lanes4 {

#include "vec_arith.inc"

// ... in NEON.
struct Vec : VectorArith<4> {
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F v) { vst1q_f32(p, v); }
};
#include "vec_math.inc"

}  // namespace specdec::cpu::lanes4
#define SPECDEC_HAVE_LANES4 1
#else
#define SPECDEC_HAVE_LANES4 0
#endif

namespace specdec::cpu {

// dst[j] = silu(g[j] + bg[j]) * (u[j] + bu[j]) for j < 4, as the scalar silu(g) * u computes it (a null
// bias adds +0, as the scalar epilogue does).
inline void swiglu4(const float* g, const float* bg, const float* u, const float* bu, float* dst) {
#if SPECDEC_HAVE_LANES4
  using V = lanes4::Vec;
  const V::F zero = V::zero();
  const V::F gv = V::add(V::load(g), bg != nullptr ? V::load(bg) : zero);
  const V::F uv = V::add(V::load(u), bu != nullptr ? V::load(bu) : zero);
  V::store(dst, lanes4::swiglu(gv, uv));
#else
  for (int j = 0; j < 4; ++j) dst[j] = silu(g[j] + (bg != nullptr ? bg[j] : 0.0f)) * (u[j] + (bu != nullptr ? bu[j] : 0.0f));
#endif
}

}  // namespace specdec::cpu
