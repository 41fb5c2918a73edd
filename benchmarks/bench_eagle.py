#!/usr/bin/env python
"""EAGLE-3 against the other drafters on the bundled target (issue 27): tokens per target pass and tok/s for
an EAGLE-3 head (a chain of k and an EAGLE-2 tree) next to the bundled draft model (chain and tree), the
n-gram lookup, the bundled Medusa-style heads (their default tree) and plain decoding, on the code and edit workloads, interleaved repeats, medians.

The head: the bundled one (specdec_ext/default_pair/eagle/, int8 storage), or ``--head DIR``, any EAGLE-3
checkpoint made for the bundled target (``specdec train-eagle``); ``--head`` twice adds a row pair per
head (e.g. the fp32 checkpoint beside its int8 export). Each head is loaded once; ``--kernel-dtype`` is the
dtype the CPU kernels read its matrices in (Eagle3Model.kernel_dtype). Times are the calls' prefill +
decode (``stats.total_time``).

    python benchmarks/bench_eagle.py [--head DIR ...] [--prompts 4] [--max-new-tokens 96] [--k 4] [--tree 3,3,8]
                                     [--repeats 3] [--threads 1] [--workloads code,edit] [--device cuda]
                                     [--kernel-dtype bfloat16] [--prompt-lines 8]
    python benchmarks/bench_eagle.py --k 2,4,6,8 --chains-only --prompts 8 --prompt-lines 20 --repeats 1
                                     # tokens per pass of the chains at several k (a table per k)
"""
from __future__ import annotations

import argparse
import statistics

import torch

import specdec_ext
from specdec_ext.bench.workloads import workload_prompts
from specdec_ext.default_pair import load_default_eagle, load_default_pair
from specdec_ext.eagle import load_eagle


def drafters(heads, k: int, tree, target, kernel_dtype: torch.dtype, chains_only: bool = False):
    """(name, generate() keywords) of every row of the table; ``heads``: checkpoint directories (empty: the
    bundled head), each loaded once for ``target``; ``chains_only``: plain and the chains of k."""
    rows = [("plain", None), ("draft model, k", dict(k=k)), ("draft model, tree", dict(draft_tree=tree)),
            ("ngram, k", dict(draft="ngram", k=k)), ("heads, tree", dict(draft="heads"))]
    for i, head in enumerate(heads or ["eagle"]):
        model = load_default_eagle(target) if head == "eagle" else load_eagle(head, target)
        model.kernel_dtype = kernel_dtype
        eagle = specdec_ext.EagleDrafterSpec(model)
        label = "EAGLE-3" if len(heads or [0]) == 1 else f"EAGLE-3 ({i + 1})"
        rows += [(f"{label}, k", dict(draft=eagle, k=k)), (f"{label}, tree", dict(draft=eagle, draft_tree=tree))]
    return [row for row in rows if not chains_only or row[0] == "plain" or row[0].endswith(", k")]


def run_once(prompts, options, max_new_tokens: int, pair):
    """(tokens/s, tokens per target pass) over the prompts, one per call; ``pair``: (target, draft model)."""
    target, draft_model = pair
    tokens = passes = 0
    seconds = 0.0
    for prompt in prompts:
        if options is None:
            result = specdec_ext.plain_generate([prompt], target, max_new_tokens=max_new_tokens)
        else:
            rest = {key: value for key, value in options.items() if key != "draft"}
            result = specdec_ext.generate([prompt], target, options.get("draft", draft_model),
                                          max_new_tokens=max_new_tokens, **rest)
        tokens += len(result.token_ids[0])
        passes += result.stats.steps
        seconds += result.stats.total_time
    return tokens / seconds, tokens / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", action="append", default=[],
                        help="an EAGLE-3 checkpoint directory for the bundled target (repeatable; default: the "
                        "bundled head)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", default="4", help="draft length of the chains; a comma-separated list gives a table "
                        "per k (default: 4)")
    parser.add_argument("--chains-only", action="store_true", help="plain decoding and the chains only (no trees)")
    parser.add_argument("--prompt-lines", type=int, default=8, help="lines of each held-out file in a code prompt "
                        "(default: 8)")
    parser.add_argument("--tree", default="3,3,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workloads", default="code,edit")
    parser.add_argument("--device", default="cpu", help="where the pair and the head run, e.g. cuda (default: cpu; "
                        "the plan's CUDA graphs where they apply)")
    parser.add_argument("--kernel-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the dtype the CPU kernels read the EAGLE heads' matrices in (default: bfloat16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft_model, _ = load_default_pair(device=args.device)
    pair = (target, draft_model)
    tree = tuple(int(x) for x in args.tree.split(","))
    print(f"bundled target, head(s) {args.head or ['bundled']}, batch 1, {args.max_new_tokens} new tokens, k = {args.k}, tree {tree}, "
          f"{args.threads} thread(s), EAGLE kernels in {args.kernel_dtype}, device {args.device} "
          f"({torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith('cuda') else 'CPU path ' + specdec_ext.ops.cpu_isa()}), "
          f"torch {torch.__version__}")
    for k in (int(x) for x in args.k.split(",")):
        rows = drafters(args.head, k, tree, target, getattr(torch, args.kernel_dtype), args.chains_only)
        for workload in args.workloads.split(","):
            table(workload, k, rows, pair, args)


def table(workload: str, k: int, rows, pair, args) -> None:
    """One workload's rows: interleaved repeats, medians."""
    prompts = workload_prompts(workload, args.prompts, args.prompt_lines)
    for _, options in rows:  # warm-up: loads, plans, first passes
        run_once(prompts[:1], options, 8, pair)
    results = {name: [] for name, _ in rows}
    for _ in range(args.repeats):
        for name, options in rows:
            results[name].append(run_once(prompts, options, args.max_new_tokens, pair))
    plain = statistics.median(r[0] for r in results["plain"])
    print(f"\n{workload}, k = {k}: {'drafter':<20} {'tok/s':>8} {'vs plain':>9} {'tokens/pass':>12}")
    for name, runs in results.items():
        rate = statistics.median(r[0] for r in runs)
        per_pass = statistics.median(r[1] for r in runs)
        print(f"{'':>{len(workload) + 1}} {name:<20} {rate:>8.1f} {rate / plain:>8.2f}x {per_pass:>12.2f}")


if __name__ == "__main__":
    main()
