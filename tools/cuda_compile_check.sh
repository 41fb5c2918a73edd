#!/usr/bin/env bash
# Compile check of the CUDA extension on a machine without a GPU: a venv with the CUDA 13 build of
# torch, the extension built for sm_90 out of the source tree, imported, and its CUDA kernels listed.
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
venv="${SPECDEC_CUDA_VENV:-.venv-cuda}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.14.1 ninja numpy
fi
rm -rf build/cuda-lib
SPECDEC_FORCE_CUDA=1 MAX_JOBS="${MAX_JOBS:-2}" "$venv/bin/python" setup.py -q build_ext \
  --build-temp build/cuda-temp --build-lib build/cuda-lib
"$venv/bin/python" - <<'PY'
import glob, importlib.util, torch
path = glob.glob("build/cuda-lib/specdec_ext/_C*.so")[0]
spec = importlib.util.spec_from_file_location("specdec_ext._C", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert module.built_with_cuda, "the extension was built without CUDA"
ops = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("specdec_ext::"))
missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")]
for op in ops:
    print(f"{op:34s} CUDA kernel: {'yes' if op not in missing else 'NO'}")
assert ops, "no specdec_ext ops registered"
assert not missing, f"ops without a CUDA kernel: {missing}"
print(f"CUDA compile check passed: {len(ops)} ops with CUDA kernels (torch {torch.__version__})")
PY
