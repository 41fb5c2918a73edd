#!/usr/bin/env python
"""The bundled draft with its context window against the whole context (drafters/model_drafter.py).

    python benchmarks/bench_draft_window.py [--new-tokens 256] [--repeats 3] [--threads 1] [--isa avx2]

The prompts of bench_auto_k.py (``specdec demo``'s, bench_cpu_anchor's and ``specdec bench``'s, duplicates
dropped), greedy, batch 1, bf16, no EOS stop. Per prompt, one generation with each of: plain decoding, k = 4
and k="auto" drafting from the whole context ("whole": the draft's ``specdec_draft_window`` unset), and the
same from the draft's window (256 tokens, the length it was trained on: "window"). Tokens per target pass
(the same every repeat: greedy), and tokens per second of the call (medians of interleaved repeats, the
order of the runs reversed every other repeat); every output is checked against plain decoding's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _timing import machine_description  # noqa: E402

RUNS = ("plain", "k=4 whole", "k=4 window", "auto whole", "auto window")


def prompts() -> List[tuple]:
    import bench_auto_k

    seen, out = set(), []
    for group in (bench_auto_k.demo_prompts, bench_auto_k.anchor_prompts, bench_auto_k.bench_prompts):
        for label, text in group():
            if text not in seen:
                seen.add(text)
                out.append((label, text))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--isa", default=None, help="SPECDEC_CPU_ISA for this run (default: the best path)")
    args = parser.parse_args(argv)
    if args.isa:
        os.environ["SPECDEC_CPU_ISA"] = args.isa
    from specdec_ext import generate, plain_generate
    from specdec_ext.default_pair import load_default_pair
    from specdec_ext.drafters.model_drafter import DRAFT_WINDOW_ATTRIBUTE

    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_default_pair(dtype=torch.bfloat16)
    window = getattr(draft.config, DRAFT_WINDOW_ATTRIBUTE)

    def run(name: str, ids: List[int]):
        setattr(draft.config, DRAFT_WINDOW_ATTRIBUTE, window if name.endswith("window") else None)
        begin = time.perf_counter()
        if name == "plain":
            result = plain_generate([ids], target, max_new_tokens=args.new_tokens, eos_token_id=False)
        else:
            result = generate([ids], target, draft, max_new_tokens=args.new_tokens, eos_token_id=False,
                              k=4 if name.startswith("k=4") else "auto")
        seconds = time.perf_counter() - begin
        return result, len(result.token_ids[0]) / seconds

    cases = [(label, tokenizer.encode(text)) for label, text in prompts()]
    print(f"# {machine_description(torch.device('cpu'))}; the draft's window {window} tokens; "
          f"{args.new_tokens} new tokens, greedy, batch 1; medians of {args.repeats} interleaved repeats")
    run("k=4 window", cases[0][1])  # warm-up (the probes and the shared costs of k="auto")
    rates: Dict[str, Dict[str, List[float]]] = {label: {name: [] for name in RUNS} for label, _ in cases}
    passes: Dict[str, Dict[str, float]] = {label: {} for label, _ in cases}
    equal: Dict[str, bool] = {label: True for label, _ in cases}
    for repeat in range(args.repeats):
        for label, ids in cases:
            outputs = {}
            for name in (RUNS if repeat % 2 == 0 else tuple(reversed(RUNS))):
                result, rate = run(name, ids)
                rates[label][name].append(rate)
                passes[label][name] = result.stats.tokens_per_pass if name != "plain" else 1.0
                outputs[name] = result.token_ids
            equal[label] &= all(outputs[name] == outputs["plain"] for name in RUNS)
    print("\n| prompt | prompt tokens | tok/pass k=4 whole | window | tok/s plain | k=4 whole | k=4 window | "
          "auto whole | auto window | window / whole, k=4 | auto | equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {"k=4": [], "auto": []}
    for label, ids in cases:
        median = {name: statistics.median(rates[label][name]) for name in RUNS}
        k4 = median["k=4 window"] / median["k=4 whole"]
        auto = median["auto window"] / median["auto whole"]
        ratios["k=4"].append(k4)
        ratios["auto"].append(auto)
        print(f"| {label} | {len(ids)} | {passes[label]['k=4 whole']:.2f} | "
              f"{passes[label]['k=4 window']:.2f} | {median['plain']:.1f} | {median['k=4 whole']:.1f} | "
              f"{median['k=4 window']:.1f} | {median['auto whole']:.1f} | {median['auto window']:.1f} | "
              f"{k4:.2f}x | {auto:.2f}x | {'yes' if equal[label] else 'NO'} |")
    for kind, values in ratios.items():
        print(f"# window / whole, {kind}: median {statistics.median(values):.3f}, lowest {min(values):.3f}, "
              f"highest {max(values):.3f}")
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
