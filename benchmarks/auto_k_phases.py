#!/usr/bin/env python
"""Where a k="auto" generation's time goes beyond plain decoding's, phase by phase (issue 25, part 4).

bench_auto_k.py says how far k="auto" stands from plain decoding on a prompt; this says where the
difference is spent. One prompt of bench_auto_k's groups (bundled pair in bf16, greedy, batch 1, one
thread), plain_generate and generate() with the default k alternated over --repeats runs in one process;
each phase below is timed at its function's calls (perf_counter around the call: a microsecond each) and
reported as the median over the runs of its seconds per generation, for each method, and their difference:

  plan        generate.make_plan             the decode plan (the drafter's checks for k="auto")
  build       generate.build                 the target's runner, and the drafter with its runner
  prefill     decode.prefill                 the target's prompt
  decode      decode.plain_chains (plain) or decode.timed_segment (k="auto": plain chain segments while off)
  steps       Stepper.step                   speculative steps (k="auto" switched on: draft and verify)
  looks       DrafterPrefill.greedy_look     the draft's windowed prefill and its look passes
  controller  AdaptiveK start/plan/observe/finish and decode.skip_drafter
  total       the whole call

    python benchmarks/auto_k_phases.py --prompt "code 1" --isa avx2 --repeats 12
"""
from __future__ import annotations

import argparse
import collections
import functools
import importlib
import inspect
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import bench_auto_k

PHASES = {  # phase -> (module, owner (None: the module's function), function names)
    "plan": ("specdec_ext.generate", None, ("make_plan",)),
    "build": ("specdec_ext.generate", None, ("build",)),
    "prefill": ("specdec_ext.decode", None, ("prefill",)),
    "decode": ("specdec_ext.decode", None, ("plain_chains", "timed_segment")),
    "steps": ("specdec_ext.step", "Stepper", ("step",)),
    "looks": ("specdec_ext.decode", "DrafterPrefill", ("greedy_look",)),
    "controller": ("specdec_ext.adaptive", "AdaptiveK", ("start", "plan", "observe", "finish")),
    "controller ": ("specdec_ext.decode", None, ("skip_drafter",)),  # (the same phase: the drafter's skip)
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default="code 1", help="a prompt label of bench_auto_k's groups (default: code 1)")
    p.add_argument("--isa", choices=["amxbf16", "avx512bf16", "avx2", "neon", "portable"],
                   help="force the CPU kernels' instruction-set path (SPECDEC_CPU_ISA)")
    p.add_argument("--repeats", type=int, default=12, help="timed runs of each method, alternated (default: 12)")
    return p.parse_args(argv)


def instrument(spent: Dict[str, float]) -> None:
    """Wrap every function of PHASES so that its calls add their seconds to ``spent[phase]``; a call inside
    another timed one (timed_segment's plain_chains) counts once, in the outer phase."""
    depth = [0]

    def timed(fn: Callable, phase: str) -> Callable:
        def charge(begin: float) -> None:
            depth[0] -= 1
            if depth[0] == 0:
                spent[phase.strip()] += time.perf_counter() - begin

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            depth[0] += 1
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                charge(begin)

        @functools.wraps(fn)
        def generator_wrapper(*args, **kwargs):  # (plain_chains yields: its time is spent in each next())
            inner = fn(*args, **kwargs)
            while True:
                depth[0] += 1
                begin = time.perf_counter()
                try:
                    item = next(inner)
                except StopIteration as stop:
                    return stop.value
                finally:
                    charge(begin)
                yield item
        return generator_wrapper if inspect.isgeneratorfunction(fn) else wrapper

    for phase, (module_name, owner_name, names) in PHASES.items():
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        for name in names:
            setattr(owner, name, timed(getattr(owner, name), phase))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.isa:
        os.environ["SPECDEC_CPU_ISA"] = args.isa
    import torch

    from specdec_ext import generate, ops, plain_generate
    from specdec_ext.default_pair import load_default_pair

    torch.set_num_threads(1)
    target, draft, tokenizer = load_default_pair(dtype=torch.bfloat16)
    groups = {label: (group, text) for group in bench_auto_k.GROUPS.values() for label, text in group.prompts()}
    if args.prompt not in groups:
        raise SystemExit(f"--prompt: one of {', '.join(groups)}")
    group, text = groups[args.prompt]
    ids = tokenizer(text)["input_ids"]
    kw = dict(tokenizer=tokenizer, max_new_tokens=group.new_tokens, **({} if group.eos else {"eos_token_id": False}))
    methods = {"plain": lambda: plain_generate([ids], target, **kw),
               "auto": lambda: generate([ids], target, draft, cost_probe=group.cost_probe, **kw)}
    spent: Dict[str, float] = collections.defaultdict(float)
    instrument(spent)
    runs: Dict[str, Dict[str, List[float]]] = {m: collections.defaultdict(list) for m in methods}
    for m in methods:  # warm-up (and k="auto"'s start-up probes)
        methods[m]()
    for rep in range(args.repeats):
        for m in (list(methods) if rep % 2 == 0 else list(methods)[::-1]):
            spent.clear()
            begin = time.perf_counter()
            methods[m]()
            runs[m]["total"].append(time.perf_counter() - begin)
            for phase in {p.strip() for p in PHASES}:
                runs[m][phase].append(spent.get(phase, 0.0))
    print(f"{args.prompt!r} ({group.name}, {len(ids)} prompt tokens, {group.new_tokens} new): CPU kernels on the "
          f"{ops.cpu_isa()} path{' (forced)' if args.isa else ''}, load average {os.getloadavg()[0]:.2f}; medians "
          f"over {args.repeats} alternated runs, ms per generation")
    print(f"{'phase':12s} {'plain':>9s} {'k=auto':>9s} {'auto - plain':>13s}")
    for phase in ["plan", "build", "prefill", "decode", "steps", "looks", "controller", "total"]:
        plain, auto = (statistics.median(runs[m][phase]) * 1e3 for m in methods)
        print(f"{phase:12s} {plain:9.2f} {auto:9.2f} {auto - plain:+13.2f}")
    ratios = [p / a for p, a in zip(runs["plain"]["total"], runs["auto"]["total"])]
    print(f"k='auto' / plain in tokens per second: {statistics.median(ratios):.3f} (median of the runs' pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
