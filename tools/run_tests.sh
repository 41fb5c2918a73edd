#!/usr/bin/env bash
# The project's test command (README): the Python suite, and the C++ suites under ctest, built with
# AddressSanitizer and UndefinedBehaviorSanitizer (tools/sanitizer_tests.sh: the CPU op tests, every
# instruction-set path of the CPU kernels, and every CUDA kernel run on the CPU by the project's
# emulator). The Python suite runs on one thread, so the C++ build runs beside it on the other cores
# (MAX_JOBS, default: all cores but one) and its tests after it. Run it inside the environment where
# specdec_ext is installed (editable install). GoogleTest and CMake come from Debian, installed here
# when missing and running as root (tools/cmake_prerequisites.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/cmake_prerequisites.sh

cores="$(nproc)"
mkdir -p build
build_log=build/cpp-suite-build.log
# A process group of its own (setsid), so that a failing Python suite stops the whole build.
MAX_JOBS="${MAX_JOBS:-$(( cores > 1 ? cores - 1 : 1 ))}" setsid tools/sanitizer_tests.sh --build-only > "$build_log" 2>&1 &
cpp_build=$!
trap 'kill -- -"$cpp_build" 2>/dev/null || true' EXIT

python -m pytest python_tests -q -p no:cacheprovider

echo "waiting for the C++ suites' build (log: $build_log)"
wait "$cpp_build" || { cat "$build_log"; exit 1; }
MAX_JOBS="${MAX_JOBS:-$cores}" tools/sanitizer_tests.sh
