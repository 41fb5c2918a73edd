#!/usr/bin/env bash
# The CUDA install as a user makes it, on a machine without a GPU: a venv with the CUDA 13 build of
# torch (nvcc at /usr/local/cuda), then the plain `pip install .` README gives for a GPU machine (no
# --no-build-isolation, no SPECDEC_FORCE_CUDA). The installed specdec_ext._C must be the CUDA build for
# that torch (built for sm_90: no GPU is visible), with a CUDA kernel for every op but
# the CPU-only ones (specdec_ext.ops.CPU_ONLY_OPS). Then the same
# binary is imported under the CPU torch of .venv (when there) and must be refused, with the message.
#   SPECDEC_CUDA_VENV (default .venv-cuda), SPECDEC_CPU_VENV (default .venv), MAX_JOBS (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."
export MAX_JOBS="${MAX_JOBS:-2}"
venv="${SPECDEC_CUDA_VENV:-.venv-cuda}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q torch==2.14.1 ninja numpy
fi
venv="$(cd "$venv" && pwd)"

start=$(date +%s)
"$venv/bin/pip" install -q .  # the user's command
echo "pip install . (CUDA torch) took $(( $(date +%s) - start )) s"

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
# From a scratch folder, so that the installed package is imported, not the source tree.
(cd "$scratch" && "$venv/bin/python" - <<'PY'
import torch
import specdec_ext
from specdec_ext import _C
print(f"installed {specdec_ext.__file__}: torch {_C.torch_version} (CUDA {_C.torch_cuda_version}), "
      f"built_with_cuda {_C.built_with_cuda}")
assert "site-packages" in specdec_ext.__file__, "imported the source tree, not the installed package"
assert _C.built_with_cuda, "pip install . gave a CPU-only extension in a CUDA torch environment"
assert _C.torch_version == torch.__version__ and _C.torch_cuda_version == torch.version.cuda
ops = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.startswith("specdec_ext::"))
from specdec_ext.ops import CPU_ONLY_OPS
cpu_only = sorted(f"specdec_ext::{name}" for name in CPU_ONLY_OPS)
missing = [op for op in ops if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")]
for op in ops:
    kind = "CPU only" if op in cpu_only else ("yes" if op not in missing else "NO")
    print(f"{op:34s} CUDA kernel: {kind}")
assert ops, "no specdec_ext ops registered"
assert set(cpu_only) <= set(ops), f"CPU_ONLY_OPS names ops that are not registered: {set(cpu_only) - set(ops)}"
# Exact: a new op without its CUDA kernel fails, and so does a CPU-only op that gained one unlisted.
assert missing == cpu_only, f"ops without a CUDA kernel: {missing}; CPU-only by design: {cpu_only}"
print(f"CUDA install check passed: {len(ops) - len(cpu_only)} ops with CUDA kernels, "
      f"{len(cpu_only)} CPU-only (torch {torch.__version__})")
PY
)

# The CUDA build under a CPU torch: refused before loading, with both versions and the fix.
cpu_venv="${SPECDEC_CPU_VENV:-.venv}"
cpu_python="$(cd "$cpu_venv" 2>/dev/null && pwd)/bin/python"
if [ -x "$cpu_python" ] && "$cpu_python" -c 'import torch, sys; sys.exit(torch.version.cuda is not None)'; then
  site="$(cd "$scratch" && "$venv/bin/python" -c 'import os, specdec_ext; print(os.path.dirname(specdec_ext.__file__))')"
  ln -s "$site" "$scratch/specdec_ext"
  (cd "$scratch" && PYTHONPATH="$scratch" "$cpu_python" - <<'PY'
import torch
try:
    import specdec_ext
except ImportError as error:
    message = str(error)
    print(f"{type(error).__name__}: {message}")
    assert type(error).__name__ == "ExtensionMismatchError", type(error)
    assert f"running {torch.__version__}" in message and "built with 2.14.1" in message, message
    assert "pip install" in message, message
else:
    raise SystemExit(f"the CUDA build of {specdec_ext.__file__} loaded into torch {torch.__version__}")
print("mismatch check passed: the CUDA build is refused under the CPU torch")
PY
  )
else
  echo "mismatch check skipped: no CPU torch venv at ${SPECDEC_CPU_VENV:-.venv}"
fi
