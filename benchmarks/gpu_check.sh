#!/usr/bin/env bash
# The one-call GPU check (an H100/H200 with nvcc, torch and transformers installed; no internet):
#
#   1. env      nvidia-smi, python / torch / transformers / pytest versions
#   2. build    pip install --no-build-isolation --no-deps .  (TORCH_CUDA_ARCH_LIST=9.0, MAX_JOBS=16)
#   3. tests    CUDA tests: test_cuda_ops.py, test_cuda_tree.py, test_kv_ops.py::test_cuda_matches_cpu,
#               test_cuda_graphs.py (graph replay == eager), test_serve_graphs.py (serving's graphs by batch
#               bucket and by draft length == eager), test_profiling.py, the CUDA heads/trees test, process_logits' CUDA tests
#               and EAGLE-3 chains under real graphs == eager
#               (test_cuda_ops.py holds sample_filtered's)
#   3b. sanitizers  compute-sanitizer memcheck, racecheck and synccheck, each over the small CUDA cases of
#               python_tests/test_cuda_sanitizer_cases.py (every kernel, checked against the CPU ops);
#               their output goes to tests.log, their error counts to the summary (GPU_CHECK_SANITIZERS=0: off)
#   4. tpot     benchmarks/bench_tpot.py --device cuda (eager vs graphs, plain vs speculative, 1B verify cost),
#               bench_serve.py --device cuda at 1 and 32 clients (speculative, k by load over captured lengths,
#               vs plain: tokens/s, TPOT p99), bench_serve_steps.py --device cuda (the same engines in-process
#               at 32 slots: each kind of step's time, the speculative server's host parts), bench_eagle.py --device cuda (EAGLE-3 chain, in CUDA graphs, and
#               tree beside the other drafters), then bench_tree_decode.py --device
#               cuda (chains vs draft trees at N = 8, 16); all into tpot.log
#   5. kernels  bench_sampling.py --quick, bench_tree.py (small), bench_kv.py --quick, all --device cuda
#   6. tp       with two GPUs or more: bench_tp.py --tp 1,2 (tensor-parallel target, plain vs speculative;
#               into tpot.log); skipped on one GPU
#
# Run order (what a short lease should measure first): env, build, tests, memcheck, bench_tpot, the kernel
# benchmarks, bench_serve, bench_serve_steps, bench_eagle, bench_tree_decode, racecheck, synccheck, tp.
#
# Every phase runs under `timeout`, clamped to what is left of a total budget (GPU_CHECK_BUDGET, default
# 510 s), so one hang cannot eat the lease; a phase whose prerequisite failed is skipped; the summary
# table is printed (and written) whatever happened. Logs: $OUT (the device tool collects it) or
# /tmp/specdec_gpu_check; eight files (env, build, tests, tpot, bench_sampling, bench_tree, bench_kv logs and summary.md: the
# device tool brings back 8 at most).
#
#   bash tools/gpu_wheels.sh                # here, once: the wheels the machine's image lacks, into .whl/
#   bash benchmarks/gpu_check.sh            # through the device tool: run(command="bash benchmarks/gpu_check.sh",
#                                           #   carry=[".whl"])
#
# Tests and benchmarks run from a scratch directory so that `import specdec_ext` finds the installed
# package (with its compiled _C), not the source tree. pytest is used when importable; otherwise the
# tests phase says so and is skipped (the benchmarks still run).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
LOG="${OUT:-/tmp/specdec_gpu_check}"
mkdir -p "$LOG"
BUDGET="${GPU_CHECK_BUDGET:-510}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
SCRATCH="$(mktemp -d)"
# The wheels tools/gpu_wheels.sh downloads for packages the machine's image lacks (carry .whl).
if compgen -G "$REPO/.whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" \
    "$REPO"/.whl/*.whl && export PYTHONPATH="$SCRATCH/site${PYTHONPATH:+:$PYTHONPATH}"
fi
SUMMARY=()
FAILED_LOGS=()
declare -A STATUS

# phase NAME CAP_SECONDS LOGFILE CMD...: run CMD under timeout (min(CAP, budget left)), append to LOGFILE
phase() {
  local name="$1" cap="$2" logfile="$3"
  shift 3
  local left=$((BUDGET - SECONDS))
  local limit=$((cap < left ? cap : left))
  if ((limit < 15)); then
    STATUS[$name]="skipped"
    SUMMARY+=("| $name | SKIPPED: time budget spent | 0 | - |")
    return
  fi
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG/$logfile"
  (cd "$SCRATCH" && timeout --kill-after=10 "$limit" "$@") >>"$LOG/$logfile" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  local verdict="ok"
  if ((rc == 124 || rc == 137)); then verdict="TIMED OUT after ${limit}s"; elif ((rc != 0)); then verdict="FAILED (rc $rc)"; fi
  STATUS[$name]="$verdict"
  [ "$verdict" = "ok" ] || FAILED_LOGS+=("$name:$logfile")
  SUMMARY+=("| $name | $verdict | $took | $logfile |")
  echo "=== $name: $verdict in ${took}s" | tee -a "$LOG/$logfile"
}

skip() {  # skip NAME REASON
  STATUS[$1]="skipped"
  SUMMARY+=("| $1 | SKIPPED: $2 | 0 | - |")
}

# 1. env --------------------------------------------------------------------------------------------
phase env 30 env.log bash -c "nvidia-smi; $PY -c 'import sys, torch, transformers; print(sys.version); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"available\", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else \"\"); print(\"transformers\", transformers.__version__)'; for m in pytest numpy scipy hypothesis ninja; do $PY -c \"import \$m; print('\$m', getattr(\$m, '__version__', '?'))\" || echo \"\$m MISSING\"; done; which nsys ncu || true"

# 2. build ------------------------------------------------------------------------------------------
phase build 240 build.log bash -c "cd '$REPO' && $PY -m pip install --no-build-isolation --no-deps --no-index . && cd / && $PY -c 'import specdec_ext._C as c, specdec_ext; print(\"installed\", specdec_ext.__file__, \"built_with_cuda\", c.built_with_cuda); assert c.built_with_cuda'"
BUILT="${STATUS[build]}"

# 3. tests ------------------------------------------------------------------------------------------
if [ "$BUILT" != "ok" ]; then
  skip tests "build $BUILT"
elif ! $PY -c "import pytest" 2>/dev/null; then
  skip tests "pytest is not installed"
else
  phase tests 150 tests.log "$PY" -m pytest -q -p no:cacheprovider -rs \
    "$REPO/python_tests/test_cuda_ops.py" "$REPO/python_tests/test_cuda_tree.py" \
    "$REPO/python_tests/test_kv_ops.py::test_cuda_matches_cpu" "$REPO/python_tests/test_token_buffer.py" \
    "$REPO/python_tests/test_cuda_graphs.py" "$REPO/python_tests/test_serve_graphs.py::test_real_cuda_graphs_give_the_eager_tokens" \
    "$REPO/python_tests/test_serve_graphs.py::test_real_cuda_graphs_with_draft_lengths_by_load_give_the_eager_tokens" \
    "$REPO/python_tests/test_serve_graphs.py::test_real_cuda_graphs_with_an_eagle_head_give_the_eager_tokens" \
    "$REPO/python_tests/test_profiling.py" \
    "$REPO/python_tests/test_heads.py::test_cuda_heads_and_sampled_trees_match_the_cpu" \
    "$REPO/python_tests/test_process_logits.py::test_cuda_matches_cpu" \
    "$REPO/python_tests/test_process_logits.py::test_cuda_long_prefixes_and_bad_values" \
    "$REPO/python_tests/test_process_logits.py::test_cuda_graph_capture" \
    "$REPO/python_tests/test_eagle_generate.py::test_eagle_chains_under_real_cuda_graphs_equal_the_eager_run"
fi

# 3b. compute-sanitizer ----------------------------------------------------------------------------
# Each tool runs the small cases in a fresh process; its "ERROR SUMMARY" (and racecheck's hazard summary)
# lines are what the summary reports. Output goes to tests.log: the device tool brings back 8 files.
# memcheck runs right after the tests; racecheck and synccheck last, so that a short lease spends its
# time on the benchmarks first.
SANITIZER_TOOLS=(memcheck racecheck synccheck)
SANITIZER="$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")"
sanitize() {  # sanitize TOOL...
  local tool cap
  for tool in "$@"; do
    if [ "${GPU_CHECK_SANITIZERS:-1}" = "0" ]; then
      skip "$tool" "GPU_CHECK_SANITIZERS=0"
    elif [ "$BUILT" != "ok" ]; then
      skip "$tool" "build $BUILT"
    elif [ ! -x "$SANITIZER" ]; then
      skip "$tool" "compute-sanitizer not found (PATH, \$CUDA_HOME/bin)"
    elif ! $PY -c "import pytest" 2>/dev/null; then
      skip "$tool" "pytest is not installed"
    else
      cap=50
      [ "$tool" = racecheck ] && cap=70
      phase "$tool" "$cap" tests.log "$SANITIZER" --tool "$tool" --error-exitcode 3 \
        "$PY" -m pytest -q -p no:cacheprovider -x "$REPO/python_tests/test_cuda_sanitizer_cases.py"
    fi
  done
}
sanitize memcheck

# The counts one tool's run printed into tests.log (between its phase's header and result lines).
sanitizer_counts() {
  local section
  section="$(sed -n "/^=== $1 (limit/,/^=== $1: /p" "$LOG/tests.log" 2>/dev/null)"
  local errors hazards
  errors="$(printf '%s\n' "$section" | grep -Eo 'ERROR SUMMARY: [0-9]+ error' | tail -1 | grep -Eo '[0-9]+')"
  hazards="$(printf '%s\n' "$section" | grep -Eo 'RACECHECK SUMMARY: [0-9]+ hazard[^(]*\([^)]*\)' | tail -1)"
  if [ -z "$errors" ]; then
    echo "no ERROR SUMMARY line (see tests.log)"
  else
    echo "$errors${hazards:+; $hazards}"
  fi
}

# 4. TPOT, then 5. the kernel benchmarks, then the rest of 4 ------------------------------------------
# (ordered by what a short lease should measure first: the decode loop's TPOT, then the kernels)
if [ "$BUILT" != "ok" ]; then
  skip tpot "build $BUILT"
  skip kernels "build $BUILT"
else
  phase tpot 170 tpot.log "$PY" "$REPO/benchmarks/bench_tpot.py" --device cuda
  phase bench_sampling 60 bench_sampling.log "$PY" "$REPO/benchmarks/bench_sampling.py" --device cuda --quick
  phase bench_kv 60 bench_kv.log "$PY" "$REPO/benchmarks/bench_kv.py" --device cuda --quick
  phase bench_tree 45 bench_tree.log "$PY" "$REPO/benchmarks/bench_tree.py" --device cuda --nodes 8 32 --batch 1 16 --repeats 10
  phase serve 100 tpot.log "$PY" "$REPO/benchmarks/bench_serve.py" --device cuda --clients 1,32 \
    --modes speculative,plain --repeats 1 --requests-per-client 2
  phase serve_steps 60 tpot.log "$PY" "$REPO/benchmarks/bench_serve_steps.py" --device cuda --slots 32 --repeats 2
  phase eagle 70 tpot.log "$PY" "$REPO/benchmarks/bench_eagle.py" --device cuda --prompts 2 --max-new-tokens 64 \
    --repeats 1
  phase trees 60 tpot.log "$PY" "$REPO/benchmarks/bench_tree_decode.py" --device cuda --ks 8,16 --branches 3 \
    --temperatures 0,1 --repeats 1 --max-new-tokens 48 --prompts 2
fi

sanitize racecheck synccheck

# 6. tensor parallelism (a machine with two GPUs or more) ---------------------------------------------
GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
if [ "$BUILT" != "ok" ]; then
  skip tp "build $BUILT"
elif [ "${GPUS:-0}" -lt 2 ]; then
  skip tp "${GPUS:-0} GPU(s): tensor parallelism needs 2"
else
  phase tp 120 tpot.log "$PY" "$REPO/benchmarks/bench_tp.py" --tp 1,2 --device cuda --dtype bfloat16 --repeats 2 \
    --max-new-tokens 48
fi

# summary --------------------------------------------------------------------------------------------
{
  echo
  echo "## gpu_check summary ($(date -u +%FT%TZ), ${SECONDS}s of a ${BUDGET}s budget)"
  echo
  echo "| phase | result | seconds | log |"
  echo "|---|---|---|---|"
  printf '%s\n' "${SUMMARY[@]}"
  if [ -f "$LOG/tests.log" ]; then
    echo
    echo "tests: $(sed -n '/^=== tests (limit/,/^=== tests:/p' "$LOG/tests.log" | grep -E '[0-9]+ (passed|failed|error)' | tail -1)"
  fi
  if [ "${STATUS[memcheck]:-}" != "" ] || [ "${STATUS[racecheck]:-}" != "" ] || [ "${STATUS[synccheck]:-}" != "" ]; then
    echo
    echo "compute-sanitizer over python_tests/test_cuda_sanitizer_cases.py:"
    echo
    echo "| tool | result | errors reported |"
    echo "|---|---|---|"
    for tool in "${SANITIZER_TOOLS[@]}"; do
      echo "| $tool | ${STATUS[$tool]:-not run} | $(sanitizer_counts "$tool") |"
    done
  fi
  for entry in "${FAILED_LOGS[@]}"; do
    echo
    echo "last lines of ${entry#*:} (${entry%%:*}):"
    tail -n 8 "$LOG/${entry#*:}" | sed 's/^/    /'
  done
  if [ -f "$LOG/tpot.log" ]; then
    echo
    sed -n '/^| model/,$p' "$LOG/tpot.log"
  fi
} | tee "$LOG/summary.md"
rm -rf "$SCRATCH"
