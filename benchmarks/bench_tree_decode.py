#!/usr/bin/env python
"""Chain vs draft-tree speculative decoding at equal verify budget, on one (target, draft) pair.

For each chain length k of --ks (default 4, 8, 16) the chain (k drafts, k + 1 tokens per target pass)
runs next to draft trees of N = k nodes (``generate(..., draft_tree=(b, d, N))``: the draft's top-b at
each of d levels, the levels' sizes spreading the N-node budget; see drafters/tree_drafter.py), so
every row of one k verifies the same k + 1 tokens per target pass. Batch 1, over held-out prompts of the
bundled pair (files it never trained on; specdec_ext/bench/workloads.py) or --prompt-file. A tree ranks its
nodes by the rate at which the target emitted similar candidates before (drafters/calibration.py); that
table lives with the draft model across calls, so it learns during the warm-up and the repeats, as in
a long-running server.

Columns: tokens/s (median over repeats of total new tokens / total time over the prompts), tokens per
target pass (new tokens / target forward calls, prefill included), draft forwards per step, and whether
the output equals the chain's at greedy (it must: both are lossless; at T > 0 the samples differ).
Methods are interleaved within each repeat (repeat -> method -> prompt) so load drift hits them alike.
In bf16 (the default dtype) a verify pass over several tokens can flip a near-tie argmax relative to a
pass over fewer tokens, so the chain and a tree may each differ from plain greedy now and then (both
match it in fp32: --dtype float32); "same as chain" = NO there is that, not a lost token.
At T > 0 both sample their drafts from the draft's q (the tree draws each node's children without
replacement) and both verify by rejection sampling (the tree's recursive form): both lossless.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Tuple

import torch

from specdec_ext.arg_types import subset_of
from specdec_ext.bench.compare import WORKLOADS, PassCounter, load, run_methods, workloads_of

DEFAULT_KS = (4, 8, 16)


def trees_for(k: int, branches: List[int]) -> List[Tuple[int, int, int]]:
    """Tree shapes (b, d, N = k): for each b, expansion depth d = k (deep enough for the chain's path)
    and d = ceil(k / 2)."""
    return [(b, d, k) for b in branches for d in sorted({k, (k + 1) // 2}, reverse=True)]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model path/id (default: the bundled pair; give --draft too)")
    p.add_argument("--draft", help="draft model path/id")
    p.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)))
    p.add_argument("--branches", default="2,3", help="tree branching factors b (default: 2,3)")
    p.add_argument("--temperatures", default="0,1", help="sampling temperatures (default: 0,1)")
    p.add_argument("--workloads", type=subset_of(WORKLOADS), default=["code"],
                   help="one of code, edit (specdec_ext/bench/workloads.py; default: code)")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--lines", type=int, default=20)
    p.add_argument("--prompt-file", action="append", default=[])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--runner", default="auto", choices=["auto", "paged", "recompute"])
    p.add_argument("--device", default="cpu", help="where both models run, e.g. cuda (default: cpu)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    from specdec_ext.generate import generate

    target, draft, tokenizer = load(args)
    (prompts,) = workloads_of(args, tokenizer).values()
    ks = [int(x) for x in args.ks.split(",") if x.strip()]
    branches = [int(x) for x in args.branches.split(",") if x.strip()]
    temperatures = [float(x) for x in args.temperatures.split(",") if x.strip()]
    counter = PassCounter(target)

    def method(k, tree, temperature):
        def run(prompt):
            kw = dict(draft_tree=tree) if tree else dict(k=k)
            r = generate([prompt], target, draft, tokenizer=tokenizer, max_new_tokens=args.new, runner=args.runner,
                         cost_probe=False, temperature=temperature, seed=0, eos_token_id=False, **kw)
            return r.token_ids[0], r.stats
        return run

    methods: Dict[Tuple[float, int, str], callable] = {}
    for temperature in temperatures:
        for k in ks:
            methods[(temperature, k, "chain")] = method(k, None, temperature)
            for tree in trees_for(k, branches):
                methods[(temperature, k, f"tree (b, d, N) = {tree}")] = method(k, tree, temperature)

    print(f"pair: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, draft "
          f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M params, {args.dtype}, {args.threads} thread(s); "
          f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens, {args.max_new_tokens} new tokens, "
          f"batch 1, {args.repeats} repeats", flush=True)
    results = run_methods(methods, prompts, counter, args)  # warm-up, then interleaved repeats

    print(f"\n{'T':>3} {'k=N':>3} {'method':<30} {'tok/s':>8} {'vs chain':>8} {'tok/pass':>9} {'same as chain':>14}")
    for name, m in results.items():
        temperature, k, label = name
        chain = results[(temperature, k, "chain")]
        same = "-" if temperature > 0 else ("yes" if m.outputs == chain.outputs else "NO")
        print(f"{temperature:>3g} {k:>3} {label:<30} {m.tokens_per_s:>8.1f} {m.tokens_per_s / chain.tokens_per_s:>7.2f}x "
              f"{m.tokens_per_pass:>9.2f} {same:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
