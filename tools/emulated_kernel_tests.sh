#!/usr/bin/env bash
# Every CUDA kernel of csrc/cuda run on the CPU by the project's emulator (cpp_tests/cuda_emu) and
# checked against the CPU ops (cpp_tests/emulated), plus the emulator's own tests. Needs no GPU and
# no CUDA toolkit. Run inside the environment where torch is installed (.venv); see docs/testing.md.
#   tools/emulated_kernel_tests.sh                 # build into build/emulated, run under ctest
#   CUDA_EMU_ORDER=reverse tools/emulated_kernel_tests.sh   # another schedule of the threads
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/cmake_prerequisites.sh
build="${SPECDEC_EMULATED_BUILD:-build/emulated}"
cmake -S . -B "$build" -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" -DSPECDEC_EMULATED_TESTS=ON >/dev/null
cmake --build "$build" -j"${MAX_JOBS:-2}" --target cuda_emu_tests specdec_emulated_tests
start=$SECONDS
ctest --test-dir "$build" -L emulated -j"${MAX_JOBS:-2}" --output-on-failure
echo "emulated kernel tests ran in $((SECONDS - start)) s"
