// The instruction-set paths of the CPU forward kernels (small_gemm.h, attention.h; one file each in
// simd/) and which one a call takes: the best this CPU runs, or the one SPECDEC_CPU_ISA names
// (avx512bf16 | avx2 | portable on x86-64, neon | portable on AArch64),
// so that every path can be tested on one machine. The environment is read at every call (a getenv
// is nothing next to a GEMM) so that a test can switch paths inside one process.
//
// The x86 paths are compiled into every x86 build (function-level target pragmas, see isa_target.h)
// and chosen at run time, so the extension still loads and runs on a CPU without AVX-512 or AVX2; NEON
// is part of AArch64's baseline.
#pragma once
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace specdec::cpu {

enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512Bf16 = 2, kNeon = 3 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kNeon:
      return "neon";
    default:
      return "portable";
  }
}

inline bool isa_supported(Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (isa) {
    case Isa::kAvx512Bf16:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case Isa::kNeon:
      return false;
    default:
      return true;
  }
#elif defined(__aarch64__)
  return isa == Isa::kPortable || isa == Isa::kNeon;
#else
  return isa == Isa::kPortable;
#endif
}

inline Isa best_isa() {
  static const Isa best = isa_supported(Isa::kAvx512Bf16) ? Isa::kAvx512Bf16
                          : isa_supported(Isa::kAvx2)     ? Isa::kAvx2
                          : isa_supported(Isa::kNeon)     ? Isa::kNeon
                                                          : Isa::kPortable;
  return best;
}

// The path a call takes now. Throws std::invalid_argument for an unknown name and std::runtime_error
// for a path this CPU cannot run (forcing one must never execute an illegal instruction).
inline Isa selected_isa() {
  const char* forced = std::getenv("SPECDEC_CPU_ISA");
  if (forced == nullptr || forced[0] == '\0' || std::strcmp(forced, "auto") == 0) return best_isa();
  for (Isa isa : {Isa::kAvx512Bf16, Isa::kAvx2, Isa::kNeon, Isa::kPortable}) {
    if (std::strcmp(forced, isa_name(isa)) != 0) continue;
    if (!isa_supported(isa))
      throw std::runtime_error(std::string("SPECDEC_CPU_ISA=") + forced + " but this CPU does not support it");
    return isa;
  }
  throw std::invalid_argument(std::string("SPECDEC_CPU_ISA=") + forced +
                              " is not one of avx512bf16, avx2, neon, portable, auto");
}

}  // namespace specdec::cpu
