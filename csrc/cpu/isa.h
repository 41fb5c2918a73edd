// The instruction-set paths of the CPU forward kernels (small_gemm.h, attention.h; one file each in
// simd/) and which one a call takes: the best this CPU runs, or the one SPECDEC_CPU_ISA names
// (amxbf16 | avx512bf16 | avx2 | portable on x86-64, neon | portable on AArch64),
// so that every path can be tested on one machine. The environment is read at every call (a getenv
// is nothing next to a GEMM) so that a test can switch paths inside one process.
//
// The x86 paths are compiled into every x86 build (function-level target pragmas, see isa_target.h)
// and chosen at run time, so the extension still loads and runs on a CPU without AVX-512 or AVX2; NEON
// is part of AArch64's baseline. amxbf16 is the avx512bf16 path whose bf16 GEMMs from memory run on
// Intel AMX tiles (simd/amx.h); Linux hands a process the tiles' state only when asked (arch_prctl).
#pragma once
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace specdec::cpu {

enum class Isa { kPortable = 0, kAvx2 = 1, kAvx512Bf16 = 2, kNeon = 3, kAmxBf16 = 4 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAmxBf16:
      return "amxbf16";
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

// CPUID.(7, 0):EDX bits 24 (AMX-TILE) and 22 (AMX-BF16); GCC 12's __builtin_cpu_supports knows neither.
// Asked once: in a VM every CPUID traps to the hypervisor, and a forced path is checked at every op call.
inline bool cpu_has_amx_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    return (edx >> 24 & 1u) != 0 && (edx >> 22 & 1u) != 0;
  }();
  return has;
#else
  return false;
#endif
}

// Asks Linux once for this process's permission to use the AMX tile data (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA: the kernel grants it process-wide, to every thread); false where it refuses.
inline bool amx_permitted() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return permitted;
#else
  return false;
#endif
}

inline bool isa_supported(Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (isa) {
    case Isa::kAmxBf16:
      return isa_supported(Isa::kAvx512Bf16) && cpu_has_amx_bf16() && amx_permitted();
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
  static const Isa best = isa_supported(Isa::kAmxBf16)      ? Isa::kAmxBf16
                          : isa_supported(Isa::kAvx512Bf16) ? Isa::kAvx512Bf16
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
  for (Isa isa : {Isa::kAmxBf16, Isa::kAvx512Bf16, Isa::kAvx2, Isa::kNeon, Isa::kPortable}) {
    if (std::strcmp(forced, isa_name(isa)) != 0) continue;
    if (!isa_supported(isa))
      throw std::runtime_error(std::string("SPECDEC_CPU_ISA=") + forced + " but this CPU does not support it");
    return isa;
  }
  throw std::invalid_argument(std::string("SPECDEC_CPU_ISA=") + forced +
                              " is not one of amxbf16, avx512bf16, avx2, neon, portable, auto");
}

}  // namespace specdec::cpu
