#!/usr/bin/env bash
# The venvs of tools/test_hf_versions.sh (.venv-tf5180) and tools/cuda_compile_check.sh (.venv-cuda),
# created with the same packages those scripts would install. .ci/run starts this in the background;
# either script still creates its venv itself when run alone.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-tf5180/bin/python ]; then
  python3 -m venv .venv-tf5180
  .venv-tf5180/bin/pip install -q torch==2.13.0 numpy pytest hypothesis scipy "llguidance>=1.9,<2" "transformers==5.18.0"
fi
if [ ! -x .venv-cuda/bin/python ]; then
  python3 -m venv .venv-cuda
  .venv-cuda/bin/pip install -q --upgrade pip
  .venv-cuda/bin/pip install -q torch==2.14.1 ninja numpy
fi
echo "side venvs ready"
