#!/usr/bin/env bash
# The project's test command (README): the Python suite, then the C++ suite under ctest.
# Run it inside the environment where specdec_ext is installed (editable install).
# GoogleTest comes from Debian's libgtest-dev, installed here when missing and running as root.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pytest python_tests -q -p no:cacheprovider

if [ ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] && [ ! -d /usr/include/gtest ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq libgtest-dev cmake >/dev/null
  else
    echo "GoogleTest is missing: run 'sudo apt-get install libgtest-dev'" >&2
    exit 1
  fi
fi
torch_prefix="$(python -c 'import torch; print(torch.utils.cmake_prefix_path)')"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B build/cmake "${generator[@]}" -DCMAKE_PREFIX_PATH="$torch_prefix" >/dev/null
cmake --build build/cmake -j"${MAX_JOBS:-2}"
ctest --test-dir build/cmake --output-on-failure
