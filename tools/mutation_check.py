#!/usr/bin/env python3
"""Mutation evidence for the emulated CUDA kernel tests (docs/testing.md).

Applies known bugs to the CUDA sources one at a time, in a scratch copy of csrc/ and cpp_tests/,
rebuilds the emulated kernel tests (cpp_tests/emulated) and runs them; a mutation is caught when at
least one test fails (a wrong result, or an emulator error such as a divergent barrier). One more
mutation, an out-of-bounds read, runs under the AddressSanitizer build instead, which must report
it. Prints a Markdown table (and writes it with --output). Takes about 15-20 minutes on 2 cores.

    . .venv/bin/activate && python tools/mutation_check.py [--only NAME ...] [--output table.md]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBS = os.environ.get("MAX_JOBS", "2")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str      # relative to the repository root
    old: str       # must occur exactly once in the file
    new: str
    breaks: str    # what the bug does
    sanitizer: bool = False  # run under the ASan + UBSan build (the bug is an invalid access)


MUTATIONS = [
    Mutation("mask-barrier-removed", "csrc/cuda/tree.cuh",
             "  __syncthreads();  // the zero fill is complete before the true entries are written\n", "",
             "build_tree_mask: the mask's zero fill races with the ancestor writes"),
    Mutation("scan-barrier-removed", "csrc/cuda/distribution.cuh",
             "    __syncthreads();  // the scan's storage is reused by the reduction below\n", "",
             "block_inverse_cdf: the block scan's storage is overwritten while being read"),
    Mutation("fast-path-barrier-removed", "csrc/cuda/sampling.cuh",
             "    __syncthreads();\n  }\n\n  // p at position i", "  }\n\n  // p at position i",
             "chain_decide_kernel: position statistics read before the warps wrote them"),
    Mutation("child-search-off-by-one", "csrc/cuda/tree.cuh",
             "for (int64_t c = start + threadIdx.x; c < n; c += kThreads) {",
             "for (int64_t c = start + threadIdx.x; c < n - 1; c += kThreads) {",
             "tree_verify: the last used node is never found as a child"),
    Mutation("warp-reduction-16-lanes", "csrc/cuda/distribution.cuh",
             "for (int delta = 16; delta > 0; delta >>= 1) {\n    MaxStats other;",
             "for (int delta = 8; delta > 0; delta >>= 1) {\n    MaxStats other;",
             "warp_merge_stats: the max over chunk statistics covers 16 of 32 lanes"),
    Mutation("tree-residual-is-p", "csrc/cuda/tree.cuh",
             "const float r = __fmul_rn(w, inv_mass) - q;", "const float r = __fmul_rn(w, inv_mass);",
             "tree_verify: after a rejection p is kept instead of max(0, p - q)"),
    Mutation("chain-residual-is-p", "csrc/cuda/distribution.cuh",
             "const float r = __fmul_rn(w, inv_mass) - q;", "const float r = __fmul_rn(w, inv_mass);",
             "chain_verify: the recovered token is drawn from p instead of max(0, p - q)"),
    Mutation("residual-mass-without-the-draft", "csrc/cuda/sampling.cuh",
             "d.push_level(nullptr, x, __fmul_rn(d.mass - weight_x, 1.0f / d.mass));",
             "d.push_level(nullptr, x, __fmul_rn(d.mass, 1.0f / d.mass));",
             "chain_verify: the residual of a deterministic draft keeps mass 1 instead of 1 - p(x)"),
    Mutation("stats-chunk-drops-last-logit", "csrc/cuda/sampling.cuh",
             "? begin + kStatsChunk : p.vocab;", "? begin + kStatsChunk - 1 : p.vocab;",
             "chain_stats_kernel: the last logit of every full 8192-logit chunk is skipped"),
    Mutation("top-k-off-by-one", "csrc/cuda/distribution.cuh",
             "static_cast<float>(filter.top_k)}, true);", "static_cast<float>(filter.top_k + 1)}, true);",
             "block_filter_threshold: top-k keeps k + 1 tokens"),
    Mutation("greedy-ties-take-a-later-index", "csrc/cuda/distribution.cuh",
             "if (span_max > thread_max) {  // strict", "if (span_max >= thread_max) {  // strict",
             "block_row_stats: on ties the argmax moves to a later span"),
    Mutation("draw-check-and-instead-of-or", "csrc/cuda/verifier_row.cuh",
             "if (__syncthreads_or(bad)) status = kStatusInvalidUniform;",
             "if (__syncthreads_and(bad)) status = kStatusInvalidUniform;",
             "both verifiers: a uniform outside [0, 1) is reported only if every thread saw one"),
    Mutation("kv-compact-destination-off-by-one", "csrc/cuda/kv_cache.cuh",
             "const int64_t q = first + j;", "const int64_t q = first + j + 1;",
             "kv_compact: every accepted node lands one position late"),
    Mutation("philox-column-shift", "csrc/cuda/sampling.cuh",
             "philox_uniform(seed[r], offset[r], index % columns)", "philox_uniform(seed[r], offset[r], index % columns + 1)",
             "philox_uniforms: draw c of a row is draw c + 1"),
    Mutation("residual-probs-reads-past-the-row", "csrc/cuda/sampling.cuh",
             "load_group(q_row, start, vocab, 0.0f, qv[g]);", "load_group(q_row, start, vocab + 1, 0.0f, qv[g]);",
             "residual_probs_kernel: reads one element past the end of each q row", sanitizer=True),
]


def run(command, cwd, env=None, timeout=None, check=True):
    result = subprocess.run(command, cwd=cwd, env=env, timeout=timeout, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if check and result.returncode != 0:
        sys.exit(f"command failed ({result.returncode}): {' '.join(command)}\n{result.stdout[-4000:]}")
    return result


def scratch_copy() -> str:
    scratch = tempfile.mkdtemp(prefix="specdec-mutation-")
    files = run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "csrc", "cpp_tests",
                 "CMakeLists.txt"], ROOT).stdout.split()
    for path in files:
        os.makedirs(os.path.join(scratch, os.path.dirname(path)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, path), os.path.join(scratch, path))
    return scratch


def configure(scratch: str, build: str, sanitize: bool) -> None:
    import torch  # noqa: F401  (the prefix of the torch this environment runs)
    import torch.utils
    flags = ["-DSPECDEC_EMULATED_TESTS=ON", f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"]
    if sanitize:
        flags += ["-DSPECDEC_SANITIZE=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo", "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O0"  # as tools/sanitizer_tests.sh]
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run(["cmake", "-S", scratch, "-B", build, *generator, *flags], scratch)


def build_tests(scratch: str, build: str) -> None:
    run(["cmake", "--build", build, "-j", JOBS, "--target", "specdec_emulated_tests"], scratch)


def run_tests(build: str, sanitize: bool, gtest_filter: str = "*"):
    """Runs the emulated tests in 2 shards; returns (failed test names, number of tests, log tail)."""
    env = dict(os.environ, GTEST_TOTAL_SHARDS="2")
    if sanitize:
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    shards = []
    for shard in range(2):
        report = os.path.join(build, f"shard{shard}.json")
        if os.path.exists(report):
            os.remove(report)
        shard_env = dict(env, GTEST_SHARD_INDEX=str(shard))
        command = [os.path.join(build, "specdec_emulated_tests"), f"--gtest_filter={gtest_filter}",
                   f"--gtest_output=json:{report}"]
        shards.append((report, subprocess.Popen(command, env=shard_env, text=True, stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT)))
    failed, total, tail = [], 0, ""
    for report, process in shards:
        try:
            output, _ = process.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
            output += "\n(timed out)"
        tail += output[-3000:]
        if not os.path.exists(report):  # the process died (an abort, a sanitizer report)
            failed.append(f"(a test process aborted, exit code {process.returncode})")
            continue
        with open(report) as f:
            results = json.load(f)
        for suite in results["testsuites"]:
            for test in suite["testsuite"]:
                total += 1
                if test.get("failures"):
                    failed.append(f"{suite['name']}.{test['name']}")
    return failed, total, tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="run only these mutations (by name)")
    parser.add_argument("--output", help="also write the Markdown table here")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    args = parser.parse_args()
    mutations = [m for m in MUTATIONS if not args.only or m.name in args.only]
    started = time.time()
    scratch = scratch_copy()
    rows = []
    try:
        for sanitize in (False, True):
            batch = [m for m in mutations if m.sanitizer == sanitize]
            if not batch:
                continue
            build = os.path.join(scratch, "build-sanitize" if sanitize else "build")
            configure(scratch, build, sanitize)
            build_tests(scratch, build)
            baseline, total, tail = run_tests(build, sanitize)
            if baseline:
                sys.exit(f"the unmutated tests fail ({'sanitizer' if sanitize else 'plain'} build): {baseline}\n{tail}")
            print(f"baseline ({'ASan + UBSan' if sanitize else 'plain'} build): {total} tests pass", flush=True)
            for m in batch:
                path = os.path.join(scratch, m.path)
                with open(path) as f:
                    original = f.read()
                if original.count(m.old) != 1:
                    sys.exit(f"{m.name}: the text to mutate occurs {original.count(m.old)} times in {m.path}")
                line = original[:original.index(m.old)].count("\n") + 1
                start = time.time()
                with open(path, "w") as f:
                    f.write(original.replace(m.old, m.new))
                try:
                    build_tests(scratch, build)
                    failed, total, tail = run_tests(build, sanitize)
                finally:
                    with open(path, "w") as f:
                        f.write(original)
                sanitizer_report = ("AddressSanitizer" in tail or "runtime error" in tail) if sanitize else None
                caught = bool(failed) and (sanitizer_report is not False)
                rows.append((m, line, failed, total, sanitizer_report, caught, time.time() - start))
                print(f"{m.name}: {'caught' if caught else 'NOT CAUGHT'} ({len(failed)}/{total} tests fail)", flush=True)
    finally:
        if args.keep:
            print(f"scratch copy kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    lines = ["| mutation | where | what it breaks | failing tests | first failing test | caught |",
             "|---|---|---|---|---|---|"]
    for m, line, failed, total, report, caught, _ in rows:
        aborted = [f for f in failed if f.startswith("(a test process aborted")]
        count = f"{len(failed)}/{total}" if not aborted else f"{len(failed) - len(aborted)}/{total}, {len(aborted)} shard aborted"
        first = failed[0] if failed else "-"
        if report:
            first += ": a sanitizer report"
        lines.append(f"| {m.name} | {m.path}:{line} | {m.breaks} | {count} | {first} | "
                     f"{'yes' if caught else '**no**'} |")
    lines.append("")
    lines.append(f"{sum(r[5] for r in rows)}/{len(rows)} mutations caught in {time.time() - started:.0f} s")
    table = "\n".join(lines)
    print(table)
    if args.output:
        with open(args.output, "w") as f:
            f.write(table + "\n")
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
