#!/usr/bin/env python
"""k="auto" against plain decoding, prompt by prompt (issue 25: "k=auto never loses").

Every prompt of the three places that compare speculative decoding with the default k against plain
decoding of the bundled pair (bf16, greedy, batch 1), each measured as that place measures it:

  demo    ``specdec demo``: the first 20 lines of 3 held-out files, 64 new tokens, no EOS stop;
          tokens/s = new tokens / the generation's time, prefill included (GenerationStats)
  anchor  ``benchmarks/bench_cpu_anchor.py`` (its ``prompts()``): the first 25 lines of 8 stdlib
          modules, 128 new tokens, no EOS stop; tokens/s = (new tokens - 1) / (time - prefill)
  bench   ``specdec bench``'s workloads (specdec_ext/bench/workloads.py): 3 code and 3 edit prompts of
          20 lines, 96 new tokens, the target's EOS; tokens/s = new tokens / the wall time of the call

Per prompt: plain and k="auto" tokens/s (medians over interleaved repeats: repeat -> prompt ->
method, the order of the methods reversed every other repeat) and their ratio: the median over the
repeats of auto / plain within a repeat (the two runs of a pair are back to back, so a slow phase of a
shared machine hits both), in the group's measure and, beside it, in the other measures: the other two
places' and "cpu", tokens per CPU second of the process, which at one thread is what the wall clock
reads on an idle machine (time slices lost to other processes do not count, their contention for
caches and memory does). Then the mean draft length k="auto" chose, its acceptance, the share of
plain chain passes (speculation off) and whether the tokens equal plain greedy's. ``--fixed-k``
adds fixed draft lengths, to show what speculating would have gained; ``--control`` runs plain
decoding twice, the second run's ratio to the first being the noise floor of the machine. "below" counts
the repeats whose auto / plain fell below the goal: a prompt below it in every repeat is below it beyond
this machine's noise in the sense of a sign test (5 of 5: 1 in 32 by chance, were a repeat as likely
above the goal as below), where a median below it may be the noise (BENCHMARKS.md, "What a below-floor
prompt pays"). Each group starts from a fresh controller state (the costs and priors k="auto" shares
within a process) and a warm-up, as a process of its own would.

    python benchmarks/bench_auto_k.py --repeats 5                 # the best ISA path of this CPU
    python benchmarks/bench_auto_k.py --repeats 5 --isa avx2      # SPECDEC_CPU_ISA=avx2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

GOAL = 0.97  # k="auto" at least this fraction of plain decoding on every prompt
MEASURES = ("total", "decode", "wall", "cpu")  # the three places' tokens per second, and per CPU second
WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Group:
    """One place's prompts and how it runs and measures them."""

    name: str
    prompts: Callable[[], List[Tuple[str, str]]]  # -> [(label, text)]
    new_tokens: int
    eos: bool  # stop at the target's EOS (else eos_token_id=False)
    cost_probe: bool  # generate()'s cost_probe
    measure: str  # one of MEASURES


@dataclass
class Runs:
    """One method on one prompt, per repeat: tokens/s in each measure, and what k="auto" chose."""

    rates: Dict[str, List[float]] = field(default_factory=lambda: {m: [] for m in MEASURES})
    mean_k: List[float] = field(default_factory=list)
    acceptance: List[float] = field(default_factory=list)
    off_share: List[float] = field(default_factory=list)
    tokens: Optional[List[int]] = None  # the last run's

    def median(self, measure: str) -> float:
        return statistics.median(self.rates[measure])

    def ratio(self, other: "Runs", measure: str) -> float:
        """Median over the repeats of self / other within a repeat."""
        return statistics.median(self.ratios(other, measure))

    def ratios(self, other: "Runs", measure: str) -> List[float]:
        """self / other within each repeat."""
        return [a / b for a, b in zip(self.rates[measure], other.rates[measure])]


def mean(values: List[float]) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def demo_prompts() -> List[Tuple[str, str]]:
    from specdec_ext.cli import DEMO_FILES, DEMO_PROMPT_LINES, heldout_prompts

    return [(os.path.basename(name), text) for name, text in heldout_prompts(DEMO_FILES, DEMO_PROMPT_LINES)]


def anchor_prompts() -> List[Tuple[str, str]]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_cpu_anchor

    return list(zip(bench_cpu_anchor.MODULES, bench_cpu_anchor.prompts(25)))


def bench_prompts() -> List[Tuple[str, str]]:
    from specdec_ext.bench.workloads import WORKLOADS, workload_prompts

    return [(f"{w} {i}", text) for w in WORKLOADS for i, text in enumerate(workload_prompts(w, 3, 20))]


GROUPS = {
    "demo": Group("demo", demo_prompts, 64, eos=False, cost_probe=True, measure="total"),
    "anchor": Group("anchor", anchor_prompts, 128, eos=False, cost_probe=True, measure="decode"),
    "bench": Group("bench", bench_prompts, 96, eos=True, cost_probe=False, measure="wall"),
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", choices=["amxbf16", "avx512bf16", "avx2", "neon", "portable"],
                   help="force the CPU kernels' instruction-set path (SPECDEC_CPU_ISA; default: the best this "
                   "CPU runs)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1, as specdec demo and bench)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved timed repeats; medians (default: 5)")
    p.add_argument("--groups", default=",".join(GROUPS), help=f"subset of {','.join(GROUPS)} (default: all)")
    p.add_argument("--fixed-k", type=int, nargs="*", default=[], help="also run these fixed draft lengths")
    p.add_argument("--control", action="store_true",
                   help="also run plain decoding a second time: its ratio to the first is the noise floor")
    return p.parse_args(argv)


def run_once(group: Group, method: str, ids: List[int], target, draft, tokenizer, new_tokens: int):
    """(GenerationResult, wall seconds, process CPU seconds) of one generation; method "plain", "auto"
    (generate()'s default k) or "k=N"."""
    from specdec_ext import generate, plain_generate

    kw = dict(tokenizer=tokenizer, max_new_tokens=new_tokens)
    if not group.eos:
        kw["eos_token_id"] = False
    begin, cpu = time.perf_counter(), time.process_time()
    if method in ("plain", "plain again"):
        result = plain_generate([ids], target, **kw)
    elif method == "auto":
        result = generate([ids], target, draft, cost_probe=group.cost_probe, **kw)
    else:
        result = generate([ids], target, draft, k=int(method[2:]), cost_probe=group.cost_probe, **kw)
    return result, time.perf_counter() - begin, time.process_time() - cpu


def record(runs: Runs, result, wall: float, cpu: float) -> None:
    s = result.stats
    runs.rates["total"].append(s.new_tokens / s.total_time)
    runs.rates["decode"].append((s.new_tokens - 1) / (s.total_time - s.prefill_time))
    runs.rates["wall"].append(s.new_tokens / wall)
    runs.rates["cpu"].append(s.new_tokens / cpu)
    runs.tokens = result.token_ids[0]
    if s.adaptive is not None:
        runs.mean_k.append(s.adaptive["mean_row_k"])
        runs.acceptance.append(s.acceptance_rate)
        runs.off_share.append(s.adaptive.get("plain_chain_passes", 0) / max(s.steps, 1))


def run_group(group: Group, methods: List[str], target, draft, tokenizer,
              repeats: int) -> Tuple[List[str], Dict[str, Dict[str, Runs]]]:
    from specdec_ext import adaptive

    adaptive._SHARED.pop(target, None)  # a fresh process's controller state: probes, priors
    prompts = group.prompts()
    ids = [tokenizer(text)["input_ids"] for _, text in prompts]
    for method in methods:  # warm-up (and the controller's start-up probes)
        run_once(group, method, ids[0], target, draft, tokenizer, WARMUP_TOKENS)
    runs = {label: {method: Runs() for method in methods} for label, _ in prompts}
    for rep in range(repeats):
        for (label, _), prompt in zip(prompts, ids):
            for method in (methods if rep % 2 == 0 else methods[::-1]):
                record(runs[label][method], *run_once(group, method, prompt, target, draft, tokenizer,
                                                      group.new_tokens))
    return [label for label, _ in prompts], runs


def report(group: Group, methods: List[str], labels: List[str],
           runs: Dict[str, Dict[str, Runs]]) -> Tuple[float, float]:
    """Print the group's table; returns its lowest auto / plain ratio in its own measure and in "cpu"."""
    others = [m for m in MEASURES if m != group.measure]
    fixed = [m for m in methods if m not in ("plain", "auto")]
    print(f"\n=== {group.name}: {len(labels)} prompts, {group.new_tokens} new tokens, "
          f"{'EOS stop' if group.eos else 'no EOS stop'}; tokens/s and ratio as {group.name} counts them "
          f"({group.measure}), then the ratio in the other measures")
    print(f"{'prompt':<16} {'plain tok/s':>11} {'auto tok/s':>10} {'ratio':>6} "
          + " ".join(f"{m + ' ratio':>12}" for m in others)
          + f" {'mean k':>6} {'accept':>6} {'off %':>5} {'same':>4} {'below':>5}"
          + "".join(f" {m + ' ratio':>9}" for m in fixed))
    worst = worst_cpu = float("inf")
    every: List[str] = []  # below the goal in every repeat
    for label in labels:
        plain, auto = runs[label]["plain"], runs[label]["auto"]
        ratio = auto.ratio(plain, group.measure)
        below = sum(r < GOAL for r in auto.ratios(plain, group.measure))
        repeats = len(plain.rates[group.measure])
        worst = min(worst, ratio)
        worst_cpu = min(worst_cpu, auto.ratio(plain, "cpu"))
        flag = "" if ratio >= GOAL else "  < goal"
        if below == repeats:
            every.append(label)
        print(f"{label:<16} {plain.median(group.measure):>11.1f} {auto.median(group.measure):>10.1f} {ratio:>5.2f}x "
              + " ".join(f"{auto.ratio(plain, m):>11.2f}x" for m in others)
              + f" {mean(auto.mean_k):>6.2f} {mean(auto.acceptance):>6.2f} {100 * mean(auto.off_share):>5.0f} "
              f"{'yes' if auto.tokens == plain.tokens else 'NO':>4} {f'{below}/{repeats}':>5}"
              + "".join(f" {runs[label][m].ratio(plain, group.measure):>8.2f}x" for m in fixed) + flag)
    print(f"lowest ratio {worst:.3f} (goal >= {GOAL}); in cpu {worst_cpu:.3f}; below the goal in every repeat: "
          + (", ".join(every) if every else "none"))
    return worst, worst_cpu


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.isa:
        os.environ["SPECDEC_CPU_ISA"] = args.isa  # read by the kernels at each call; set before any runs
    import torch

    from specdec_ext import ops
    from specdec_ext.default_pair import load_default_pair

    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_default_pair(dtype=torch.bfloat16)
    groups = [GROUPS[g.strip()] for g in args.groups.split(",") if g.strip()]
    methods = ["plain", "auto"] + [f"k={k}" for k in args.fixed_k] + (["plain again"] if args.control else [])
    print(f"k='auto' (generate()'s default k) against plain decoding: CPU kernels on the {ops.cpu_isa()} path"
          f"{' (forced)' if args.isa else ''}, {args.threads} thread(s), {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.2f}, torch {torch.__version__}; bundled pair in bf16, greedy, batch 1; "
          f"{args.repeats} interleaved repeats")
    worst = {}
    for group in groups:
        labels, runs = run_group(group, methods, target, draft, tokenizer, args.repeats)
        worst[group.name] = report(group, methods, labels, runs)
    print("\nlowest ratio per group (its measure / cpu): "
          + ", ".join(f"{name} {w:.3f} / {c:.3f}" for name, (w, c) in worst.items())
          + f"; load average now {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
