// Function-level target regions: the code between SPECDEC_BEGIN_TARGET_* and SPECDEC_END_TARGET is
// compiled for that instruction set whatever the build's -march, and is only ever called after
// isa.h's run-time check. Include <immintrin.h> before opening a region.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SPECDEC_HAVE_X86_PATHS 1
#else
#define SPECDEC_HAVE_X86_PATHS 0
#endif

// NEON is part of AArch64's baseline: no target region (simd/neon.cpp).
#if defined(__aarch64__)
#define SPECDEC_HAVE_NEON_PATH 1
#else
#define SPECDEC_HAVE_NEON_PATH 0
#endif

#if SPECDEC_HAVE_X86_PATHS
#if defined(__clang__)
#define SPECDEC_BEGIN_TARGET_AVX512BF16                                                                 \
  _Pragma("clang attribute push(__attribute__((target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c\"))), apply_to = function)")
#define SPECDEC_BEGIN_TARGET_AVX2 \
  _Pragma("clang attribute push(__attribute__((target(\"avx2,fma,f16c\"))), apply_to = function)")
#define SPECDEC_BEGIN_TARGET_AMX                                                                        \
  _Pragma("clang attribute push(__attribute__((target(\"amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c\"))), apply_to = function)")
#define SPECDEC_END_TARGET _Pragma("clang attribute pop")
#else
#define SPECDEC_BEGIN_TARGET_AVX512BF16 \
  _Pragma("GCC push_options") _Pragma("GCC target(\"avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c\")")
#define SPECDEC_BEGIN_TARGET_AVX2 _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define SPECDEC_BEGIN_TARGET_AMX \
  _Pragma("GCC push_options")    \
      _Pragma("GCC target(\"amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c\")")
#define SPECDEC_END_TARGET _Pragma("GCC pop_options")
#endif
#endif
