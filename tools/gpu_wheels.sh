#!/usr/bin/env bash
# The wheels a lent H200 machine lacks (its image has torch, transformers, pytest, numpy, scipy, but not
# llguidance, which `import specdec_ext` needs, nor the serve extra that bench_serve.py starts),
# downloaded for its Python 3.12 into .whl/ (ignored by git). benchmarks/gpu_check.sh installs them
# when .whl/ is there: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform any "${platforms[@]}" -d .whl "$@"
}
download "llguidance>=1.9,<2"
# serve: FastAPI (and what it imports that the image lacks), uvicorn; importlib-metadata 8.x needs
# only zipp (10.x adds lazy-importer)
download fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing-extensions \
  opentelemetry-api "importlib-metadata==8.7.0" uvicorn
ls .whl
