#!/usr/bin/env bash
# In-place build of specdec_ext._C for development, serialised with a lock so that several
# shells (or people) building at once do not clobber each other's ninja state.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/specdec_ext_build.lock env MAX_JOBS="${MAX_JOBS:-2}" python setup.py build_ext --inplace "$@"
