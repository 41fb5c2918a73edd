# Sourced by the scripts that build the C++ suites with CMake (emulated_kernel_tests.sh,
# sanitizer_tests.sh, mutation_check.py through them): installs GoogleTest and CMake with apt-get
# when missing (as root; a fresh CI machine has neither), checks that torch is importable, and sets
#   TORCH_PREFIX     torch's CMake prefix
#   CMAKE_GENERATOR  Ninja when available (CMake reads it from the environment)
# Run inside the environment where torch is installed (the project's .venv).
if ! command -v cmake >/dev/null || { [ ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] &&
                                      [ ! -d /usr/include/gtest ]; }; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libgtest-dev cmake >/dev/null
  else
    echo "GoogleTest or CMake is missing: run 'sudo apt-get install libgtest-dev cmake'" >&2
    exit 1
  fi
fi
TORCH_PREFIX="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')" || {
  echo "torch is not importable: activate the environment where it is installed (.venv)" >&2
  exit 1
}
export TORCH_PREFIX
if command -v ninja >/dev/null; then export CMAKE_GENERATOR=Ninja; fi
