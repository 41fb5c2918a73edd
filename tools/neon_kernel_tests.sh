#!/usr/bin/env bash
# The CPU kernels' AArch64 paths (portable and NEON, csrc/cpu/simd/neon.cpp) on this x86 machine: the
# torch-free kernel test (cpp_tests/isa/test_isa_kernels.cpp) cross-compiled with Debian's AArch64 GCC
# and run under qemu-user. Correctness only: the NEON path's speed is owed to an ARM machine. The
# compiler and qemu come from Debian's packages, installed here when missing and running as root.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null
  else
    echo "the AArch64 cross compiler or qemu-user is missing: sudo apt-get install g++-aarch64-linux-gnu qemu-user" >&2
    exit 1
  fi
fi
out="${TMPDIR:-/tmp}/specdec_isa_kernel_tests_aarch64"
aarch64-linux-gnu-g++ -std=c++20 -O2 -fno-math-errno -fno-trapping-math -ffp-contract=off -Wall -Wextra -Werror \
  -Icsrc cpp_tests/isa/test_isa_kernels.cpp csrc/cpu/simd/*.cpp -o "$out"
qemu-aarch64 -L /usr/aarch64-linux-gnu "$out"
