#!/usr/bin/env python
"""Ours against llama.cpp on the CPU (issue 18): the bundled pair in bf16, the same prompts (the first
25 lines of 8 standard-library modules), greedy, batch 1, prompt processing excluded; plain and
speculative decoding at each thread count, methods interleaved within every repeat, medians; the
generated texts compared; this VM's copy bandwidth measured in the same run; and the target's
one-token forward against the bandwidth floor of its weights.

llama.cpp is not a dependency: build it from a registry package into folders outside the repository,
one build per instruction set compared (2 cores: about 10 minutes each). Its sdist vendors llama.cpp:

    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llamacpp-dl
    tar xzf /tmp/llamacpp-dl/llama_cpp_python-*.tar.gz -C /tmp/llamacpp-dl
    llamacpp() {  # $1: "" (native), -avx2 or -portable; then the ISA options: /tmp/llamacpp$1-venv
        local src=$(echo /tmp/llamacpp-dl/llama_cpp_python-*/vendor/llama.cpp) b=/tmp/llamacpp$1-build \
            v=/tmp/llamacpp$1-venv; shift
        cmake -S $src -B $b "$@" -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF -DBUILD_SHARED_LIBS=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF
        cmake --build $b -j2 --target llama-completion llama-speculative-simple llama-tokenize
        python3 -m venv $v && $v/bin/pip install sentencepiece
        cp $b/bin/llama-* $v/bin/ && mkdir -p $v/src && ln -s $src $v/src/llama.cpp
    }
    # --isa auto / avx512bf16: everything this CPU has
    llamacpp "" -DGGML_NATIVE=ON
    # --isa avx2: AVX2 + FMA + F16C, no AVX-512 (one CPU backend, no run-time variants)
    llamacpp -avx2 -DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
        -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF \
        -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
    # --isa portable (optional): no x86 SIMD option (the compiler's x86-64 baseline, SSE2)
    llamacpp -portable -DGGML_NATIVE=OFF -DGGML_SSE42=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF \
        -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF

then ``python benchmarks/bench_cpu_anchor.py --threads 1 2 --repeats 5`` (add ``--isa avx2`` for both engines
on AVX2: SPECDEC_CPU_ISA for ours, the -avx2 build of llama.cpp). Without llama.cpp the script says so
and measures ours alone. It converts the pair to GGUF bf16 with llama.cpp's own converter (our
tokenizer is GPT-2's byte-level BPE, which the converter is told by name) and checks that llama.cpp
tokenizes every prompt as we do. Never run in CI.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import copy_bandwidth_gbs  # noqa: E402

MODULES = ["argparse", "json.decoder", "collections.abc", "functools", "pathlib", "shutil", "heapq", "csv"]
CONVERT = """
import runpy, sys
src, pre, model, out = sys.argv[1:5]
sys.path[:0] = [src, src + "/gguf-py", sys.argv[5]]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre  # the converter knows tokenizers by hash only
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "bf16", "--outfile", out]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def prompts(n_lines: int):
    out = []
    for name in MODULES:
        path = importlib.util.find_spec(name).origin
        out.append("".join(Path(path).read_text().splitlines(keepends=True)[:n_lines]))
    return out


def llamacpp_paths(root: Path):
    binaries = {name: root / "bin" / name for name in ("llama-completion", "llama-speculative-simple",
                                                        "llama-tokenize")}
    missing = [str(p) for p in binaries.values() if not p.exists()]
    src = root / "src" / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").exists():
        missing.append(str(src / "convert_hf_to_gguf.py"))
    return binaries, src, missing


def llamacpp_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True)
    return " ".join((out.stdout + out.stderr).split())


LLAMACPP_BUILDS = {"avx2": Path("/tmp/llamacpp-avx2-venv"), "portable": Path("/tmp/llamacpp-portable-venv")}
NATIVE_LLAMACPP = Path("/tmp/llamacpp-venv")


def llamacpp_root(isa: str, given: Path | None):
    """The llama.cpp folder for our instruction-set path (--llamacpp, else LLAMACPP_DIR, else the build of
    the docstring for that ISA; portable falls back to the native build when it has none), and a note."""
    if given is not None:
        return given, "given by --llamacpp"
    if os.environ.get("LLAMACPP_DIR"):
        return Path(os.environ["LLAMACPP_DIR"]), "given by LLAMACPP_DIR"
    root = LLAMACPP_BUILDS.get(isa, NATIVE_LLAMACPP)
    if isa == "portable" and not root.exists():
        return NATIVE_LLAMACPP, f"the native build: no portable build at {root}"
    return root, "the native build" if root == NATIVE_LLAMACPP else f"the {isa} build"


def llamacpp_features(binary: Path, gguf: Path) -> str:
    """The CPU features llama.cpp's CPU backend was compiled with (its system_info line: the flags = 1)."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", "a", "-n", "1", "-no-cnv", "--no-warmup", "-t", "1"],
                         capture_output=True, text=True)
    line = next((ln for ln in (out.stdout + out.stderr).splitlines() if "system_info" in ln), "")
    return " ".join(re.findall(r"(\w+) = 1\b", line.split("CPU :", 1)[-1])) or "unknown"


def convert(src: Path, root: Path, gguf_dir: Path):
    """target/draft GGUF bf16 files (made once), from the bundled HF folders plus the tokenizer."""
    from specdec_ext.default_pair import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR

    gguf_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, folder in (("target", TARGET_DIR), ("draft", DRAFT_DIR)):
        out[name] = gguf_dir / f"{name}-bf16.gguf"
        if out[name].exists():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            for f in list(Path(folder).iterdir()) + list(Path(TOKENIZER_DIR).iterdir()):
                os.symlink(f, Path(tmp) / f.name)
            extra = root / "converter-path"  # sentencepiece, which the converter imports first
            extra.mkdir(exist_ok=True)
            site = next(iter((root / "lib").glob("python*/site-packages/sentencepiece")), None)
            if site is not None and not (extra / "sentencepiece").exists():
                os.symlink(site, extra / "sentencepiece")
            subprocess.run([sys.executable, "-c", CONVERT, str(src), "gpt-2", tmp, str(out[name]), str(extra)],
                           check=True, capture_output=True)
    return out


def llamacpp_tokens(binary: Path, gguf: Path, text: str):
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", text, "--ids", "--log-disable", "--no-bos"],
                         capture_output=True, text=True, check=True)
    return [int(x) for x in re.findall(r"-?\d+", out.stdout.strip().splitlines()[-1])]


PLAIN_TIMING = re.compile(r"\seval time =\s+([\d.]+) ms /\s+(\d+) runs")  # llama-completion's decode time
SPECULATIVE_TIMING = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")  # llama-speculative-simple's
DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")  # ... and its counts
ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


def run_llamacpp(binaries, gguf, text, new_tokens, threads, draft_max=None):
    """(tokens decoded after the first, seconds, tokens per target pass, generated text)."""
    common = ["-p", text, "-n", str(new_tokens), "--temp", "0", "-t", str(threads), "--ignore-eos", "-c", "2048"]
    if draft_max is None:
        cmd = [str(binaries["llama-completion"]), "-m", str(gguf["target"]), "-no-cnv", "--no-display-prompt",
               "--no-warmup"] + common
    else:
        cmd = [str(binaries["llama-speculative-simple"]), "-m", str(gguf["target"]), "-md", str(gguf["draft"]),
               "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max), "-td", str(threads)] + common
    needed = [PLAIN_TIMING] if draft_max is None else [SPECULATIVE_TIMING, DRAFTED, ACCEPTED]
    for attempt in range(3):  # on a busy machine a run now and then ends without its timing or count lines
        out = subprocess.run(cmd, capture_output=True, text=True)
        log = out.stderr
        found = [pattern.search(log) for pattern in needed]
        if out.returncode == 0 and all(found):
            break
    else:
        raise RuntimeError(f"{cmd[0]} failed three times; its log ends:\n{log[-2000:]}")
    if draft_max is None:
        ms, runs = found[0].groups()
        return int(runs), float(ms) / 1e3, 1.0, out.stdout
    (n, seconds), drafted, accepted = found[0].groups(), int(found[1].group(1)), int(found[2].group(1))
    passes = int(n) - accepted  # every target pass yields one token besides the accepted drafts
    at = out.stdout.find(text)  # it prints the prompt (after a blank line or two), then the completion
    text_out = out.stdout[at + len(text):] if at >= 0 else out.stdout
    return int(n), float(seconds), int(n) / max(passes, 1), text_out, drafted


def run_ours(target, draft, tokenizer, ids, new_tokens, speculative):
    from specdec_ext import generate, plain_generate

    if speculative:
        r = generate([ids], target, draft, tokenizer=tokenizer, max_new_tokens=new_tokens, eos_token_id=False)
    else:
        r = plain_generate([ids], target, tokenizer=tokenizer, max_new_tokens=new_tokens, eos_token_id=False)
    s = r.stats
    return s.new_tokens - 1, s.total_time - s.prefill_time, s.tokens_per_pass if speculative else 1.0, r.token_ids[0]


def forward_floor(target, copy_gbs, threads, repeats=50, context=250):
    """The target's one-token forward at `context` positions, and its weights' bytes per pass."""
    from specdec_ext.runners import LeanLlamaRunner

    runner = LeanLlamaRunner(target, max_batch_size=1, max_seq_len=context + 16)
    runner.start([list(range(1, context + 1))])
    ids = torch.tensor([[5]])
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(ids)
        times.append(time.perf_counter() - t0)
        runner.truncate(torch.tensor([context]))
    streamed = sum(p.numel() * p.element_size() for n, p in target.named_parameters() if "embed_tokens" not in n)
    seconds = statistics.median(times[5:])
    return seconds, streamed, streamed / (copy_gbs * 1e9)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--lines", type=int, default=25, help="lines of each module's source in its prompt")
    parser.add_argument("--draft-max", type=int, default=4, help="llama.cpp's --spec-draft-n-max")
    parser.add_argument("--isa", choices=["auto", "avx512bf16", "avx2", "portable"],
                        default=os.environ.get("SPECDEC_CPU_ISA") or "auto",
                        help="our kernels' instruction-set path (sets SPECDEC_CPU_ISA) and, by default, the llama.cpp "
                             "build for it (avx2: /tmp/llamacpp-avx2-venv, portable: /tmp/llamacpp-portable-venv when "
                             "built, else /tmp/llamacpp-venv, the native build)")
    parser.add_argument("--llamacpp", type=Path, default=None,
                        help="llama.cpp folder (default: LLAMACPP_DIR, else the build for --isa)")
    parser.add_argument("--gguf-dir", type=Path, default=Path(tempfile.gettempdir()) / "specdec-gguf")
    args = parser.parse_args(argv)

    # Read by our ops at every call: set before the first one.
    os.environ["SPECDEC_CPU_ISA"] = args.isa
    from specdec_ext import ops
    from specdec_ext.default_pair import load_default_pair

    isa = ops.cpu_isa()  # raises when this CPU cannot run the path asked for
    if args.isa != "auto" and isa != args.isa:
        raise SystemExit(f"--isa {args.isa} but our kernels report the {isa} path")
    args.llamacpp, llamacpp_note = llamacpp_root(args.isa, args.llamacpp)

    target, draft, tokenizer = load_default_pair(dtype=torch.bfloat16)
    texts = prompts(args.lines)
    ids = [tokenizer(t)["input_ids"] for t in texts]
    binaries, src, missing = llamacpp_paths(args.llamacpp)
    have_llamacpp = not missing
    if not have_llamacpp:
        print(f"llama.cpp not found ({', '.join(missing)}): measuring ours alone; see this script's docstring "
              "for the build", file=sys.stderr)
    else:
        gguf = convert(src, args.llamacpp, args.gguf_dir)
        same = [llamacpp_tokens(binaries["llama-tokenize"], gguf["target"], t) == i for t, i in zip(texts, ids)]
        print(f"llama.cpp: {llamacpp_version(binaries['llama-completion'])}; {args.llamacpp} ({llamacpp_note}; "
              f"CPU features {llamacpp_features(binaries['llama-completion'], gguf['draft'])}); tokenization "
              f"identical to ours on {sum(same)}/{len(same)} prompts")
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}, "
          f"our kernels on the {ops.cpu_isa()} path (--isa {args.isa}); prompts of "
          f"{min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"{args.new_tokens} new tokens, greedy, batch 1, {args.repeats} interleaved repeats (median)")
    for threads in args.threads:
        torch.set_num_threads(threads)
        copy = copy_bandwidth_gbs(torch.device("cpu"))
        fwd, streamed, floor = forward_floor(target, copy, threads)
        print(f"\nthreads={threads}: copy bandwidth {copy:.1f} GB/s; target one-token forward at 250 positions "
              f"{fwd * 1e3:.2f} ms = {fwd / floor:.2f}x the floor ({streamed / 1e6:.1f} MB of bf16 weights read per "
              f"pass at the copy bandwidth: {floor * 1e3:.2f} ms)")
        methods = {"ours plain": lambda i, p: run_ours(target, draft, tokenizer, i, args.new_tokens, False),
                   "ours speculative (auto k)": lambda i, p: run_ours(target, draft, tokenizer, i, args.new_tokens,
                                                                      True)}
        if have_llamacpp:
            methods["llama.cpp plain"] = lambda i, p: run_llamacpp(binaries, gguf, p, args.new_tokens, threads)
            methods[f"llama.cpp speculative (draft-max {args.draft_max})"] = (
                lambda i, p: run_llamacpp(binaries, gguf, p, args.new_tokens, threads, args.draft_max))
        for fn in methods.values():  # warm-up (and the GGUF page cache)
            fn(ids[0], texts[0])
        samples = {name: [[] for _ in texts] for name in methods}
        outputs = {name: [None] * len(texts) for name in methods}
        for _ in range(args.repeats):
            for j, (i, p) in enumerate(zip(ids, texts)):
                for name, fn in methods.items():
                    res = fn(i, p)
                    samples[name][j].append(res)
                    outputs[name][j] = res[3]
        reference = [tokenizer.decode(o) for o in outputs["ours plain"]]
        print(f"{'method':42s} {'tok/s':>8s} {'tokens/pass':>11s} {'same text as ours plain':>24s}")
        for name in methods:
            tokens = sum(statistics.median(r[0] for r in runs) for runs in samples[name])
            seconds = sum(statistics.median(r[1] for r in runs) for runs in samples[name])
            per_pass = statistics.mean(statistics.median(r[2] for r in runs) for runs in samples[name])
            texts_out = [o if isinstance(o, str) else tokenizer.decode(o) for o in outputs[name]]
            # llama.cpp's printout may end in whitespace of its own
            same = sum(a.rstrip() == b.rstrip() for a, b in zip(texts_out, reference))
            print(f"{name:42s} {tokens / seconds:8.1f} {per_pass:11.2f} {same:>21d}/{len(texts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
