#!/usr/bin/env python
"""Adaptive k against fixed k: tokens/s of k="auto" next to fixed k in {0, 1, 2, 4, 6, 8}.

On the bundled pair (or --target/--draft), batch 1 by default (--batch for more rows), greedy, for
two workloads and two drafters:

* workloads   code: the first --lines lines of held-out files of the bundled pair (files it never
              trained on) to complete;
              edit: a prompt holding a function from a held-out file and asking for the same function
              with one identifier renamed ("# original\\n<function>\\n# the same function with `x`
              renamed to `y`\\n<its def line>") -- mostly a copy, where the n-gram drafter shines.
* drafters    model: the draft model (ModelDrafter); ngram: suffix-automaton lookup (NgramDrafter).

Methods run through the decode loop (specdec_ext.decode.decode) exactly as generate() does (a plan, then
build, then decode, without the text): a fresh runner, drafter and (for auto) a fresh AdaptiveK per
generation, so auto's learning within each
generation is inside the timing. As in a long-lived process, auto's one-time start-up probe of the
verify costs runs in the untimed warm-up (one short generation per method at the benchmark's batch
size), and each generation starts from the draft cost and pooled acceptance the previous one left
(AdaptiveK share_costs). The wall time of each generation is measured (prefill included). k = 0 is
plain decoding (no drafter; the same runner and sampler).

Repeats are interleaved (repeat -> method -> prompt) so load drift on a shared machine hits every
method alike; the table shows the median over repeats of (new tokens / seconds) over all prompts,
the best fixed k, and auto's ratio to it (the target: >= 0.95). Every method must produce the same
greedy tokens ("identical" column).

    python benchmarks/bench_adaptive.py                       # bundled pair, ~5-10 min on one core
    python benchmarks/bench_adaptive.py --repeats 5 --max-new-tokens 128 --prompts 4
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch

from specdec_ext.bench.workloads import code_prompts, edit_prompts

FIXED_KS = (0, 1, 2, 4, 6, 8)
WARMUP_TOKENS = 8
TARGET_RATIO = 0.95


@dataclass
class Measure:
    rates: List[float] = field(default_factory=list)  # per repeat: new tokens / seconds over all prompts
    outputs: List[List[int]] = field(default_factory=list)  # last repeat: tokens per prompt
    adaptive: List[dict] = field(default_factory=list)  # auto: AdaptiveK.summary() of each run

    @property
    def median(self) -> float:
        return statistics.median(self.rates) if self.rates else float("nan")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench_adaptive", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model path (default: the bundled pair; give --draft too)")
    p.add_argument("--draft", help="draft model path (default: the bundled pair)")
    p.add_argument("--ks", default=",".join(map(str, FIXED_KS)), help="fixed k compared (default: 0,1,2,4,6,8)")
    p.add_argument("--k-max", type=int, default=8, help="auto's largest k (default: 8)")
    p.add_argument("--prompts", type=int, default=3, help="prompts per workload (default: 3)")
    p.add_argument("--lines", type=int, default=20, help="lines of each held-out file (code workload, default: 20)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt (default: 96)")
    p.add_argument("--batch", type=int, default=1, help="rows per generation: each prompt repeated (default: 1)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed repeats (default: 3)")
    p.add_argument("--workloads", default="code,edit", help="subset of code,edit")
    p.add_argument("--drafters", default="model,ngram", help="subset of model,ngram")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="model dtype (default: bf16)")
    p.add_argument("--runner", default="paged", choices=["auto", "lean", "paged", "recompute"],
                   help="runner of target and draft (default: paged; generate()'s default is auto: lean)")
    p.add_argument("--draft-noise", type=float, default=0.0,
                   help="perturb the draft's weights by this times their std (a weaker draft: lower acceptance, "
                   "to see auto pick small k or switch off; default 0)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------ runs
def make_method(target, draft, kind: str, k, new: int, runner: str) -> Callable:
    """A function prompt-token-lists -> (tokens per row, adaptive summary or None), as generate() runs."""
    from specdec_ext.build import build
    from specdec_ext.decode import LoopConfig, decode
    from specdec_ext.models import Models
    from specdec_ext.plan import make_plan
    from specdec_ext.stats import GenerationStats
    from specdec_ext.stops import RowState, StopCriteria

    models = Models(target, "none" if k == 0 else kind, draft=draft if kind == "model" and k else None)

    def run(prompts: List[List[int]]):
        B = len(prompts)
        plan = make_plan(target, models.draft, drafter=models.drafter, prompt_lengths=[len(p) for p in prompts],
                         max_new_tokens=new, k=None if k == 0 else k, runner=runner)
        target_runner, drafter = build(plan, models)
        stats = GenerationStats(k=plan.slots, batch_size=B)
        rows = [RowState() for _ in prompts]
        for _ in decode(target_runner, drafter, prompts, torch.zeros(B, dtype=torch.int64),
                        StopCriteria(max_new_tokens=new), LoopConfig.of(plan, cost_probe=False), stats=stats,
                        rows=rows):
            pass
        return [r.tokens for r in rows], stats.adaptive

    return run


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.target is None and args.draft is None:
        from specdec_ext.default_pair import load_default_pair
        target, draft, tokenizer = load_default_pair(dtype=dtype)
    else:
        from specdec_ext.models import load_pair
        target, draft, tokenizer = load_pair(args.target, args.draft)
        target, draft = target.to(dtype), draft.to(dtype)
    if args.draft_noise > 0:
        torch.manual_seed(0)
        with torch.no_grad():
            for param in draft.parameters():
                if param.dim() > 1:
                    param.add_(args.draft_noise * param.float().std().to(param.dtype) * torch.randn_like(param))
    fixed = [int(x) for x in args.ks.split(",") if x.strip()]
    workloads = {"code": code_prompts(args.prompts, args.lines), "edit": edit_prompts(args.prompts)}
    workloads = {w: workloads[w] for w in args.workloads.split(",") if w}
    drafters = [d for d in args.drafters.split(",") if d]
    new = args.max_new_tokens
    print(f"pair: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, draft "
          f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M params, {args.dtype}, {args.threads} thread(s); "
          f"batch {args.batch}, {new} new tokens, greedy, {args.repeats} interleaved repeats"
          + (f", draft noise {args.draft_noise}" if args.draft_noise else ""), flush=True)

    # methods: (drafter, k); k = 0 (plain) is shared by both drafters
    methods: Dict[Tuple[str, object], Callable] = {("plain", 0): make_method(target, draft, "model", 0, new,
                                                                              args.runner)}
    for kind in drafters:
        for k in [k for k in fixed if k > 0] + ["auto"]:
            methods[(kind, k)] = make_method(target, draft, kind, k, new, args.runner)
    for workload, texts in workloads.items():
        prompts = [tokenizer(t)["input_ids"] for t in texts]
        batches = [[p] * args.batch for p in prompts]
        print(f"\n=== workload {workload}: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens", flush=True)
        for run in methods.values():  # warm-up (for auto also the one-time probe at this batch size)
            run([batches[0][0][:32]] * args.batch)
        results = {m: Measure() for m in methods}
        for rep in range(args.repeats):
            for method, run in methods.items():
                total_tokens, total_time, outputs = 0, 0.0, []
                for batch in batches:
                    start = time.perf_counter()
                    tokens, summary = run(batch)
                    total_time += time.perf_counter() - start
                    total_tokens += sum(len(t) for t in tokens)
                    outputs.append(tokens)
                    if summary is not None:
                        results[method].adaptive.append(summary)
                results[method].rates.append(total_tokens / total_time)
                results[method].outputs = outputs
            print(f"  repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        reference = results[("plain", 0)].outputs
        plain = results[("plain", 0)].median
        header = "".join(f"{f'k={k}':>9}" for k in fixed) + f"{'auto':>9} {'best fixed':>11} {'auto/best':>10} " \
                 f"{'auto k':>7} {'off %':>6} {'identical':>10}"
        print(f"\n{'drafter':<8}{header}    (tokens/s, medians)")
        for kind in drafters:
            rates = {k: (plain if k == 0 else results[(kind, k)].median) for k in fixed}
            auto = results[(kind, "auto")]
            best_k = max(rates, key=rates.get)
            ratio = auto.median / rates[best_k]
            differ = [str(k) for k in [k for k in fixed if k > 0] + ["auto"] if results[(kind, k)].outputs != reference]
            same = not differ
            summaries = auto.adaptive
            mean_k = statistics.mean(s["mean_row_k"] for s in summaries) if summaries else float("nan")
            steps = sum(sum(s["steps_by_width"].values()) for s in summaries)
            off = 100.0 * sum(s["speculation_off_steps"] for s in summaries) / max(steps, 1)
            row = "".join(f"{rates[k]:>9.1f}" for k in fixed)
            flag = "" if ratio >= TARGET_RATIO else "  (< target 0.95)"
            print(f"{kind:<8}{row}{auto.median:>9.1f} {f'k={best_k}':>11} {ratio:>9.3f}x {mean_k:>7.2f} {off:>5.0f}% "
                  f"{'yes' if same else 'NO':>10}{flag}" + (f"  (differ from k=0: k={','.join(differ)})" if differ else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
