#!/usr/bin/env python
"""Tensor-parallel speculative decoding: tokens/s of plain and speculative decoding at TP = 1, 2, 4.

For each TP size the script starts ``torchrun --nproc_per_node=TP`` on itself (``--worker``): every rank
loads the target sharded over the ranks (TP = 1: whole) and the draft whole, runs plain decoding and
speculative decoding (a fixed k) over the same prompts, interleaved over --repeats, and rank 0 prints
one JSON line; the parent prints the table. It also times the cost of keeping the ranks on rank 0's
decisions (tp_check broadcast / verify / off, specdec_ext/distributed.py) at TP > 1.

On a multi-GPU machine (``--device cuda``) these are the numbers that matter. On a CPU (gloo, the
default here) a TP step pays a gloo all-reduce per block (~0.5 ms each on the 2-core VM): the figures
show that the loop runs and agrees, and are labelled correctness-only.

    python benchmarks/bench_tp.py --tp 1,2                      # the bundled pair, CPU, correctness-only
    python benchmarks/bench_tp.py --target T --draft D --tp 1,2,4 --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model path (default: the bundled pair's target)")
    p.add_argument("--draft", help="draft model path (default: the bundled pair's draft)")
    p.add_argument("--tp", default="1,2", help="TP sizes (default: 1,2)")
    p.add_argument("--k", type=int, default=4, help="draft length (default: 4)")
    p.add_argument("--prompts", type=int, default=3, help="held-out code prompts (default: 3)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default: 64)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians (default: 3)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    from specdec_ext import distributed
    from specdec_ext.bench.workloads import code_prompts
    from specdec_ext.default_pair import DRAFT_DIR, TARGET_DIR, TOKENIZER_DIR
    from specdec_ext.generate import generate, plain_generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tp = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    target_path, draft_path = args.target or TARGET_DIR, args.draft or DRAFT_DIR
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR if args.target is None else target_path)
    if tp > 1:
        distributed.init_from_environment(args.device)
        target = distributed.load_tensor_parallel(target_path, tp, dtype=dtype)
    else:
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(args.device).eval()
    device = next(target.parameters()).device
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype).to(device).eval()
    prompts = [tokenizer(t)["input_ids"] for t in code_prompts(args.prompts, 20)]
    kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=False, tokenizer=tokenizer)

    def run(method):
        start = time.perf_counter()
        results = [method(p) for p in prompts]
        return time.perf_counter() - start, results

    methods = {"plain": lambda p: plain_generate([p], target, runner="paged", **kw),
               "speculative": lambda p: generate([p], target, draft, k=args.k, runner="paged", cost_probe=False, **kw)}
    if tp > 1:
        for check in ("verify", "off"):
            methods[f"speculative tp_check={check}"] = (
                lambda p, c=check: generate([p], target, draft, k=args.k, runner="paged", cost_probe=False,
                                            tp_check=c, **kw))
    for method in methods.values():  # warm-up
        method(prompts[0][:16])
    times = {name: [] for name in methods}
    outputs, passes = {}, {}
    for rep in range(args.repeats):
        for name, method in (list(methods.items()) if rep % 2 == 0 else list(methods.items())[::-1]):
            seconds, results = run(method)
            times[name].append(seconds)
            outputs[name] = [r.token_ids[0] for r in results]
            passes[name] = sum(r.stats.steps + 1 for r in results)
    tokens = args.max_new_tokens * len(prompts)
    if distributed.rank() == 0:
        print(json.dumps({"tp": tp, "device": str(device), "tokens": tokens, "passes": passes,
                          "seconds": {n: statistics.median(t) for n, t in times.items()},
                          "identical": all(o == outputs["plain"] for o in outputs.values())}), flush=True)
    distributed.destroy()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        worker(args)
        return 0
    forwarded = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--worker"]
    rows = []
    for tp in [int(x) for x in args.tp.split(",") if x.strip()]:
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={tp}", "--master_port",
                   str(29500 + tp), os.path.abspath(__file__), "--worker", *forwarded]
        out = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if out.returncode != 0 or not lines:
            print(f"TP={tp} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(lines[-1]))
    label = "" if args.device == "cuda" else "  (CPU + gloo: correctness-only, not a speed figure)"
    print(f"\n{'TP':>3} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'tok/pass':>9} "
          f"{'check verify':>13} {'check off':>10} {'identical':>10}{label}")
    print("     (check verify / off: time relative to the default tp_check=broadcast)")
    for r in rows:
        s, n = r["seconds"], r["tokens"]
        spec = s["speculative"]
        checks = [s.get(f"speculative tp_check={c}") for c in ("verify", "off")]
        verify, off = (f"{t / spec:.3f}x" if t else "-" for t in checks)
        print(f"{r['tp']:>3} {n / s['plain']:>12.1f} {n / spec:>11.1f} {s['plain'] / spec:>7.2f}x "
              f"{n / r['passes']['speculative']:>9.2f} {verify:>13} {off:>10} {'yes' if r['identical'] else 'NO':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
