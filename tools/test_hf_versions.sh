#!/usr/bin/env bash
# The HF-integration tests (paged cache equivalence against plain HF forwards, KV ops) under other
# transformers releases than the main venv's: by default 5.18 (the cache argument is still
# `past_key_values=` there). Reuses the extension built in place by the editable install (same
# torch 2.13.0, so the same ABI); one venv per release under .venv-tf<version>.
set -euo pipefail
cd "$(dirname "$0")/.."
ls specdec_ext/_C*.so >/dev/null 2>&1 || { echo "build the extension in place first (pip install -e .)" >&2; exit 1; }
for version in ${SPECDEC_HF_VERSIONS:-5.18.0}; do
  venv=".venv-tf${version//./}"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  # (a no-op where they are there already: tools/ci_side_venvs.sh installs the same list)
  "$venv/bin/pip" install -q torch==2.13.0 numpy pytest hypothesis scipy "llguidance>=1.9,<2" "transformers==$version"
  echo "== transformers $("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
  "$venv/bin/python" -m pytest python_tests/test_hf_paged.py python_tests/test_kv_ops.py \
    python_tests/test_kv_cache_hypothesis.py -q -p no:cacheprovider
done
