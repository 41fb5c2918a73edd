// The instruction-set paths of the CPU forward kernels: what the drivers (small_gemm.h, attention.h)
// call on each, and the contract of the vector traits every path provides. A path is one file that
// defines its traits and compiles the kernels for them: avx512.cpp, avx2.cpp, neon.cpp, portable.cpp (a
// new instruction set is one such file). The kernels are written once over the traits: gemm_impl.inc
// (the GEMM's panels), attention_impl.inc (cache attention), vec_math.inc (exp, SwiGLU); each path's file
// includes them inside its namespace and target region (isa_target.h), so each path is compiled once
// per build, in its own translation unit, and no other file compiles any of them.
//
// struct Vec {
//   F, Mask, Cmp          a vector of kLanes fp32 lanes; the valid lanes of a partial vector (mask(n)
//                         for the first n, n clamped to [0, kLanes]); a lane-wise comparison result
//   kLanes                lanes per vector
//   kTuning               how its kernels are shaped (PathTuning, gemm_types.h), measured on the path
//   kHasBf16Dot, Bf16Dot  a bf16-pair dot product (a Dot, gemm_impl.inc), or false / void
// The paths over GCC vector types take the lane-wise arithmetic from VectorArith (vec_arith.inc), and
// those without masked 16-bit loads their partial vectors from WithBufferedTails.
//   kRegisters            the vector registers the path has (what the GEMM's blocks may hold)
//   zero, set1, load(p[, mask]), load_widen<DType>(base, i[, mask]) (fp32/bf16/fp16 to fp32),
//   load_bf16_pairs(p, first, second) (kLanes pairs of bf16 to fp32: the first of each pair, the second),
//   store(p, v[, mask]), first(v, mask) (lanes past the mask zeroed)
//   add, sub, mul, div, fma(a, b, c) = a * b + c (one rounding), max(a, b) (b where either is NaN),
//   greater_equal (false for NaN), select(c, a, b), pow2(n) (2^n for integral n in [-126, 127])
//   reduce4(a0, a1, a2, a3, out)  out[j] = the sum of aj's lanes associated as fold_sum<kLanes>
//   sum(v) (as fold_sum<kLanes>), reduce_max(v)
// };
//
// Each path is consistent with itself (batch invariance, gemm_types.h); the paths differ from one
// another in rounding (lane counts, fused multiply-adds, bf16 pair products).
#pragma once
#include <cstdint>

#include "../attention_types.h"
#include "../gemm_types.h"
#include "../isa_target.h"

// Each path's entry points, defined by its file (gemm_impl.inc, attention_impl.inc):
//   tile_path()                            the path's GEMM for small_gemm.h's driver (TilePath)
//   attend_range(p, begin, end, scratch, keys)   tasks [begin, end) of attention_num_tasks(p) (attention.h)
#define SPECDEC_PATH_ENTRY_POINTS \
  TilePath tile_path();           \
  void attend_range(const AttentionProblem& p, int64_t begin, int64_t end, float* scratch, int64_t* keys);

namespace specdec::cpu {
namespace portable {
SPECDEC_PATH_ENTRY_POINTS
}
#if SPECDEC_HAVE_X86_PATHS
namespace avx512 {
SPECDEC_PATH_ENTRY_POINTS
}
namespace avx2 {
SPECDEC_PATH_ENTRY_POINTS
}
#endif
#if SPECDEC_HAVE_NEON_PATH
namespace neon {
SPECDEC_PATH_ENTRY_POINTS
}
#endif
}  // namespace specdec::cpu

#undef SPECDEC_PATH_ENTRY_POINTS
