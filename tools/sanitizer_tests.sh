#!/usr/bin/env bash
# The C++ suites built with AddressSanitizer and UndefinedBehaviorSanitizer: the CPU op tests
# (cpp_tests/*.cpp, with the CPU kernels of csrc/cpu instrumented) and the emulated CUDA kernel
# tests (cpp_tests/cuda_emu, cpp_tests/emulated, with the kernels of csrc/cuda instrumented). Any
# report fails the run (UBSan does not recover). Run inside the environment where torch is
# installed (.venv); see docs/testing.md. `--build-only`: build, run nothing (.ci/run builds beside the
# Python suite, which keeps one core busy, and runs the tests after it).
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/cmake_prerequisites.sh
build="${SPECDEC_SANITIZE_BUILD:-build/sanitize}"
# The tests themselves at -O0 (they compile in half the time of -O1, and the sanitizers need no
# optimisation); the code they test at -O1 as the sanitizers recommend, the CPU kernels (CMakeLists.txt),
# and the emulator and the emulated kernels at -O2 (cpp_tests/cuda_emu, cpp_tests/emulated).
cmake -S . -B "$build" -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DSPECDEC_EMULATED_TESTS=ON -DSPECDEC_SANITIZE=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O0 >/dev/null
cmake --build "$build" -j"${MAX_JOBS:-2}"
[ "${1:-}" = "--build-only" ] && exit 0
# libtorch is not instrumented and keeps allocations alive until exit (leak checks off); the
# emulator's fibers are announced to ASan, so stack switches are not reported.
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:strict_string_checks=1:check_initialization_order=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
start=$SECONDS
ctest --test-dir "$build" -j"${MAX_JOBS:-2}" --output-on-failure
echo "sanitizer tests ran in $((SECONDS - start)) s"
