#!/usr/bin/env python
"""k="auto" replayed over recorded agreement with the costs measured here: where it loses, without the noise.

bench_auto_k.py times k="auto" against plain decoding prompt by prompt, and on a shared 2-core VM its
per-prompt ratios move by 3-8% between runs of the same code (its "plain again" control): a change to the
controller worth 1% cannot be seen there. This script takes the two apart:

  record   per prompt of bench_auto_k's three groups: the target's greedy output (the lean runner, as
           generate() runs it) and, at every generated position, whether the draft's greedy token there
           equals the target's (the draft model in fp32 over the context its drafter keeps: the last
           window_keep tokens, re-windowed as ``ModelDrafter`` does), and what a look's windowed prefill
           would read at each position (decode.LOOK_WINDOW, LOOK_TOKENS). Greedy verification accepts a
           chain from position p up to the first disagreement, so this is what every draft length would
           accept at every step. Saved to --agreement (JSON) and reused.
  measure  on this machine and ISA path, medians over --repeats: a plain chain pass, the verify and draft
           time of a step of each draft length and the host time between steps (fixed-k generations), what
           a plain segment of k="auto" costs beyond a plain chain (a controller that never drafts against
           plain decoding), a look, the drafter's windowed and whole prefills and its runner's build (a
           k="auto" run that looks, timed at the drafter's calls), and the cost of a token of context.
  replay   the real controller (specdec_ext.adaptive.AdaptiveK, sharing its state across the group's prompts
           in order, as bench_auto_k runs them) over the recorded agreement, each pass costing what was
           measured times log-normal noise of --noise (seeded): per prompt the decode-time ratio to plain
           decoding (median over --seeds x --replays), and where k="auto"'s time went.

    python benchmarks/replay_auto_k.py --isa avx2                     # record once, measure, replay
    python benchmarks/replay_auto_k.py --isa avx2 --free-looks        # as if looks and draft prefills were free

The replay leaves out what the cost table cannot hold (a pass after a draft pass finding the target's weights
evicted, a slow phase of the machine while speculating): it reads lower losses than the machine does, and is
for comparing controllers and costs, not for the goal itself (bench_auto_k.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Sequence

GOAL = 0.97
K_MAX = 8  # adaptive.DEFAULT_K_MAX
SEGMENT_PAIRS = 4  # plain / never-drafting pairs per repeat for a segment's host work


@dataclass
class Agreement:
    """One prompt's record: where the draft's greedy token equals the target's."""

    label: str
    group: str
    prompt_len: int
    new_tokens: int
    steps: List[int]  # [new_tokens]: 1 where the draft, over its kept context, proposes generated token i
    first_looks: Dict[int, List[int]]  # generated tokens so far -> what a first (windowed) look reads


@dataclass
class Costs:
    """Milliseconds on this machine: V, D indexed by tokens (V[t], t = 1..K_MAX + 1; D[k], k = 0..K_MAX)."""

    plain: float  # a pass of a greedy plain chain
    verify: List[float]
    draft: List[float]
    host: float  # between two steps
    segment_host: float  # a k="auto" plain segment beyond a chain's passes
    look: float
    window_prefill: float  # decode.LOOK_WINDOW tokens
    prefill_per_token: float  # the drafter's whole prefill
    prepare: float  # the drafter's runner, built at its first prefill
    context: float  # per token of context, every pass
    measured_at: float  # the context the costs were measured at (tokens)
    keep: int = 128  # the most tokens the drafter's whole prefill feeds a row (its window_keep)
    isa: str = ""

    def free_looks(self) -> "Costs":
        return Costs(**{**asdict(self), "look": 0.0, "window_prefill": 0.0, "prefill_per_token": 0.0, "prepare": 0.0})


# ------------------------------------------------------------------------------------------ record
def record_agreement(target, draft, tokenizer) -> List[Agreement]:
    import torch

    from bench_auto_k import GROUPS
    from specdec_ext import plain_generate
    from specdec_ext.decode import LOOK_TOKENS, LOOK_WINDOW
    from specdec_ext.drafters.model_drafter import draft_window_of

    window = draft_window_of(draft)
    keep = None if window is None else window // 2
    reference = draft.float()

    def argmaxes(tokens: Sequence[int]) -> List[int]:
        with torch.no_grad():
            return reference(torch.tensor([list(tokens)])).logits[0].argmax(-1).tolist()

    records = []
    for group in GROUPS.values():
        for label, text in group.prompts():
            ids = tokenizer(text)["input_ids"]
            kw = dict(max_new_tokens=group.new_tokens, tokenizer=tokenizer)
            if not group.eos:
                kw["eos_token_id"] = False
            generated = list(plain_generate([ids], target, **kw).token_ids[0])
            full, P = ids + generated, len(ids)
            steps, start, cached, cached_from = [], 0 if keep is None else max(0, P - keep), None, None
            for i in range(len(generated)):
                committed = P + i
                if window is not None and committed - start + K_MAX + 1 > window:
                    start = committed - keep  # (the drafter prefills a row again from its last window_keep)
                if cached_from != start or len(cached) < committed - start:
                    cached, cached_from = argmaxes(full[start: min(len(full), start + (window or len(full)) + 16)]), start
                steps.append(int(cached[committed - 1 - start] == generated[i]))
            looks = {}
            for n in range(2, len(generated) + 1):
                shown, end = min(LOOK_TOKENS, n - 1), P + n
                begin = max(0, end - 1 - shown - LOOK_WINDOW)
                predicted = argmaxes(full[begin: end - 1])
                looks[n] = [int(predicted[end - shown - 1 - begin + j] == full[end - shown + j]) for j in range(shown)]
            records.append(Agreement(label, group.name, P, len(generated), steps, looks))
            print(f"# recorded {group.name} {label}: {P} prompt tokens, agreement {sum(steps) / len(steps):.2f}",
                  file=sys.stderr)
    return records


def load_agreement(path: str) -> List[Agreement]:
    with open(path) as f:
        return [Agreement(**{**r, "first_looks": {int(k): v for k, v in r["first_looks"].items()}}) for r in json.load(f)]


# ------------------------------------------------------------------------------------------ measure
def measure_costs(target, draft, tokenizer, repeats: int) -> Costs:
    from bench_auto_k import GROUPS
    from specdec_ext import adaptive, generate, plain_generate
    from specdec_ext.decode import LOOK_WINDOW
    from specdec_ext.drafters.model_drafter import ModelDrafter, draft_window_of
    from specdec_ext.ops import cpu_isa

    prompts = dict(GROUPS["anchor"].prompts())
    ids = tokenizer(prompts["json.decoder"])["input_ids"]  # (171 tokens)
    short, long_ = tokenizer(prompts["collections.abc"])["input_ids"], tokenizer(prompts["heapq"])["input_ids"]
    kw = dict(tokenizer=tokenizer, max_new_tokens=64, eos_token_id=False)
    med = statistics.median

    def decode_ms(stats) -> float:
        return (stats.total_time - stats.prefill_time) * 1e3

    plain = [decode_ms(plain_generate([ids], target, **kw).stats) / 63 for _ in range(repeats)]
    per_context = []
    for _ in range(repeats):
        a = decode_ms(plain_generate([short], target, **kw).stats) / 63
        b = decode_ms(plain_generate([long_], target, **kw).stats) / 63
        per_context.append((b - a) / (len(long_) - len(short)))
    verify, drafting, host = [math.nan] * (K_MAX + 2), [0.0] * (K_MAX + 1), []
    for k in range(1, K_MAX + 1):
        runs = [generate([ids], target, draft, k=k, **kw).stats for _ in range(repeats)]
        verify[k + 1] = med(s.verify_time / s.steps * 1e3 for s in runs)
        drafting[k] = med(s.draft_time / s.steps * 1e3 for s in runs)
        host.append(med((decode_ms(s) - (s.draft_time + s.verify_time) * 1e3) / s.steps for s in runs))
    # V(1): a one-token step (sampled plain decoding runs them: greedy plain decoding chains its passes)
    sampled = [plain_generate([ids], target, temperature=1.0, seed=0, **kw).stats for _ in range(repeats)]
    verify[1] = med(s.verify_time / s.steps * 1e3 for s in sampled)
    # a controller that never drafts (no looks) against plain decoding: the segments' host work
    never = lambda: adaptive.AdaptiveK(K_MAX, explore_every=0, prior_acceptance=0.0)
    # (a difference of two whole generations, 1-2% of either: the median of more pairs than the other costs
    # take, the order alternated, else one slow phase of the machine read as 0.9 ms a segment where 0.1-0.3 is)
    extra = []
    for pair in range(SEGMENT_PAIRS * repeats):
        runs = [lambda: plain_generate([ids], target, **kw), lambda: generate([ids], target, draft, k=never(), **kw)]
        order = runs if pair % 2 == 0 else runs[::-1]
        times = [decode_ms(run().stats) for run in order]
        a, b = times if pair % 2 == 0 else times[::-1]
        extra.append((b - a) / math.ceil(63 / 8))
    # the drafter's calls in runs that look first, then switch on (json.decoder: its looks see agreement), once
    # the start-up probes are shared (a draft probe prefills the whole context before any look)
    calls: Dict[object, List[float]] = {}
    originals = {name: getattr(ModelDrafter, name) for name in ("prepare", "prefill", "prefill_window", "look")}

    def timed(name):
        def call(self, *args, **kwargs):
            begin = time.perf_counter()
            out = originals[name](self, *args, **kwargs)
            key = (name, args[2]) if name == "prefill_window" else name  # (its window: a look's or the whole one)
            calls.setdefault(key, []).append((time.perf_counter() - begin) * 1e3)
            return out
        return call

    def looking():
        # no pooled acceptance: with a prior of 0 the generation opens with a look; with a prior of 1 it bets at
        # once and prefills the whole context after its first steps (after a look at a prior of 0 it may
        # never switch on: on forced AVX2 json.decoder's look at 7 positions did not, no whole prefill ran,
        # and the cost table's prefill per token was NaN)
        for prior in (0.0, 1.0):
            for memory in adaptive._SHARED.get(target, {}).values():
                if isinstance(memory, adaptive.DrafterMemory):
                    memory.acceptance = None
            generate([ids], target, draft, k=adaptive.AdaptiveK(K_MAX, prior_acceptance=prior), **kw)

    adaptive._SHARED.pop(target, None)
    looking()
    for name in originals:
        setattr(ModelDrafter, name, timed(name))
    try:
        for _ in range(repeats):
            looking()
    finally:
        for name, fn in originals.items():
            setattr(ModelDrafter, name, fn)
    window = draft_window_of(draft)
    keep = window // 2 if window else len(ids)  # (a whole prefill feeds the window's last half, or everything)
    whole = calls.get(("prefill_window", keep) if window else "prefill", [math.nan])
    # (the runner is built at a generation's first prefill; prepare() is cheap after it)
    built = sorted(calls.get("prepare", [0.0]))[-repeats:]
    return Costs(plain=med(plain), verify=verify, draft=drafting, host=max(med(host), 0.0),
                 segment_host=max(med(extra), 0.0), look=med(calls.get("look", [0.0])),
                 window_prefill=med(calls.get(("prefill_window", LOOK_WINDOW), [0.0])),
                 prefill_per_token=med(whole) / keep, prepare=med(built), context=max(med(per_context), 0.0),
                 measured_at=len(ids) + 32, keep=keep, isa=cpu_isa())


# ------------------------------------------------------------------------------------------ replay
class _Key:  # a weakly referenceable stand-in for the target model (adaptive's shared table)
    pass


@dataclass
class Spent:
    """Where one replayed generation's milliseconds went."""

    segments: float = 0.0
    steps: float = 0.0
    steps_plain: float = 0.0  # what plain passes would have taken for the steps' tokens
    looks: float = 0.0
    prefills: float = 0.0
    plain: float = 0.0  # plain decoding of the whole generation
    passes: int = 0  # plain segment passes
    drafting_steps: int = 0
    looks_run: int = 0

    @property
    def total(self) -> float:
        return self.segments + self.steps + self.looks + self.prefills


def run_length(agree: Sequence[int], pos: int, cap: int) -> int:
    n = 0
    while n < cap and pos + n < len(agree) and agree[pos + n]:
        n += 1
    return n


def replay_group(records: List[Agreement], costs: Costs, replays: int, seed: int, noise: float) -> Dict[str, List[Spent]]:
    """The group's prompts in order, ``replays`` times, through one controller state (bench_auto_k's order)."""
    from specdec_ext.adaptive import AdaptiveK
    from specdec_ext.decode import LOOK_TOKENS, LOOK_WINDOW, PLAIN_CHAIN_TOKENS
    from specdec_ext.stats import StepOutcome

    rng = random.Random(seed)
    jitter = lambda ms: ms * math.exp(rng.gauss(0.0, noise))
    controller, key, keep = AdaptiveK(K_MAX), _Key(), costs.keep
    out: Dict[str, List[Spent]] = {r.label: [] for r in records}
    for _ in range(replays):
        for r in records:
            shift = lambda context: costs.context * (context - costs.measured_at)
            V = lambda t, context: costs.verify[t] + shift(context)
            P = lambda context: costs.plain + shift(context)
            spent, agree, n = Spent(), r.steps, r.new_tokens
            request = controller.start(1, key, ("draft",), probe=True, plain_chain=PLAIN_CHAIN_TOKENS, looks=True)
            ready = whole = built = False
            if request.verify_widths or request.draft_counts or request.plain_passes:
                if request.draft_counts:  # the draft probe prefills the drafter first (part of the run)
                    spent.prefills += costs.prepare + costs.prefill_per_token * min(r.prompt_len, keep)
                    ready = whole = built = True
                controller.record_probes({t: V(t, r.prompt_len) / 1e3 for t in request.verify_widths},
                                         {s: costs.draft[s] / 1e3 for s in request.draft_counts},
                                         P(r.prompt_len) / 1e3 if request.plain_passes else None, r.prompt_len)
            pos, fed = 1, 1  # generated tokens committed; those the drafter has seen
            while pos < n:
                context, left = r.prompt_len + pos, n - pos
                pending = 0 if whole else min(context - 1, keep)
                k = controller.plan([True], left, pending, context=context)[0]
                if k == 0:
                    passes = min(PLAIN_CHAIN_TOKENS, left)
                    ms = sum(jitter(P(context + i)) for i in range(passes)) + costs.segment_host
                    spent.segments += ms
                    spent.passes += passes
                    controller.observe_plain(passes, ms / 1e3, [True], context + passes / 2)
                    pos += passes
                    if controller.look_due:
                        first = not ready
                        if first:
                            spent.looks += costs.window_prefill + (0.0 if built else costs.prepare)
                            ready = built = True
                            controller.record_prefill(costs.window_prefill / 1e3, LOOK_WINDOW)
                        spent.looks += jitter(costs.look)
                        spent.looks_run += 1
                        shown = min(LOOK_TOKENS, pos - 1)
                        controller.observe_look([r.first_looks[pos] if first else agree[pos - shown: pos]], [True])
                        fed = pos
                    continue
                if not whole and not (controller.looking and ready):
                    if controller.looking:
                        ms = costs.window_prefill + (0.0 if built else costs.prepare)
                        controller.record_prefill(costs.window_prefill / 1e3, LOOK_WINDOW)
                    else:
                        tokens = min(context - 1, keep)
                        ms = (0.0 if built else costs.prepare) + costs.prefill_per_token * tokens
                        controller.record_prefill(costs.prefill_per_token * tokens / 1e3, tokens)
                        whole = True
                    spent.prefills += ms
                    ready = built = True
                    fed = pos
                accepted = run_length(agree, pos, min(k, left - 1))
                # a draft pass after skipped steps also feeds their tokens: at the per-token cost of a prefill
                d = jitter(costs.draft[k]) + costs.prefill_per_token * max(pos - fed, 0)
                v, h = jitter(V(k + 1, context)), jitter(costs.host)
                controller.observe([k], StepOutcome.of([accepted], [k], [True]), draft_time=d / 1e3,
                                   verify_time=v / 1e3, drafted=k, width=k + 1, host_time=h / 1e3, context=context)
                spent.steps += d + v + h
                spent.steps_plain += sum(P(context + i) for i in range(accepted + 1))
                spent.drafting_steps += 1
                pos += accepted + 1
                fed = pos
            controller.finish()
            spent.plain = sum(jitter(P(r.prompt_len + i)) for i in range(1, n))
            out[r.label].append(spent)
    return out


# ------------------------------------------------------------------------------------------ report
def report(records: List[Agreement], costs: Costs, replays: int, seeds: int, noise: float) -> int:
    groups: Dict[str, List[Agreement]] = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    print(f"costs (ms, {costs.isa}): plain pass {costs.plain:.3f}; verify t=1..{K_MAX + 1} "
          + " ".join(f"{v:.2f}" for v in costs.verify[1:]) + "; draft k=1..8 " + " ".join(f"{d:.2f}" for d in costs.draft[1:])
          + f"; host {costs.host:.3f}; segment beyond plain {costs.segment_host:.3f}; look {costs.look:.2f}; window "
          f"prefill {costs.window_prefill:.2f}; prefill/token {costs.prefill_per_token:.4f}; runner {costs.prepare:.2f}; "
          f"context {costs.context * 1e3:.2f} us/token")
    print(f"{'group':6s} {'prompt':16s} {'ratio':>6s} {'lowest':>6s} {'off %':>5s} {'looks':>5s} {'look ms':>7s} "
          f"{'prefill ms':>10s} {'steps ms':>8s} {'as plain':>8s} {'segment ms':>10s}")
    below = 0
    for name, records_ in groups.items():
        spent = {r.label: [] for r in records_}
        for seed in range(seeds):
            for label, runs in replay_group(records_, costs, replays, seed, noise).items():
                spent[label].extend(runs)
        for r in records_:
            runs = spent[r.label]
            ratios = [s.plain / s.total for s in runs]
            ratio = statistics.median(ratios)
            below += ratio < GOAL
            m = lambda f: statistics.mean(f(s) for s in runs)
            print(f"{name:6s} {r.label:16s} {ratio:6.3f} {min(ratios):6.3f} "
                  f"{100 * m(lambda s: s.passes) / max(r.new_tokens - 1, 1):5.0f} {m(lambda s: s.looks_run):5.1f} "
                  f"{m(lambda s: s.looks):7.2f} {m(lambda s: s.prefills):10.2f} {m(lambda s: s.steps):8.2f} "
                  f"{m(lambda s: s.steps_plain):8.2f} {m(lambda s: s.segments):10.2f}{'  < goal' if ratio < GOAL else ''}")
    print(f"# {below} of {len(records)} prompts below {GOAL} (decode time, median over {seeds} seeds x {replays} replays)")
    return below


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--isa", choices=["amxbf16", "avx512bf16", "avx2", "neon", "portable"],
                   help="force the CPU kernels' instruction-set path for the cost measurement (SPECDEC_CPU_ISA)")
    p.add_argument("--agreement", default=os.path.join(tempfile.gettempdir(), "specdec_replay_agreement.json"),
                   help="the recorded agreement (JSON): made if missing, else read (default: %(default)s)")
    p.add_argument("--costs", help="a cost table (JSON) to replay with instead of measuring (--save-costs writes one)")
    p.add_argument("--save-costs", help="write the measured cost table (JSON) here")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per cost; medians (default: 3)")
    p.add_argument("--replays", type=int, default=3, help="passes over each group per seed (default: 3)")
    p.add_argument("--seeds", type=int, default=5, help="noise seeds (default: 5)")
    p.add_argument("--noise", type=float, default=0.03, help="log-normal sd of every replayed time (default: 0.03)")
    p.add_argument("--free-looks", action="store_true", help="replay with looks and draft prefills costing nothing")
    args = p.parse_args(argv)
    if args.isa:
        os.environ["SPECDEC_CPU_ISA"] = args.isa
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    torch.set_num_threads(1)
    from specdec_ext.default_pair import load_default_pair

    need_models = not os.path.exists(args.agreement) or not args.costs
    target = draft = tokenizer = None
    if need_models:
        target, draft, tokenizer = load_default_pair(dtype=torch.bfloat16)
    if os.path.exists(args.agreement):
        records = load_agreement(args.agreement)
    else:
        records = record_agreement(target, draft, tokenizer)
        with open(args.agreement, "w") as f:
            json.dump([asdict(r) for r in records], f)
    if args.costs:
        with open(args.costs) as f:
            costs = Costs(**json.load(f))
    else:
        costs = measure_costs(target, draft, tokenizer, args.repeats)
        if args.save_costs:
            with open(args.save_costs, "w") as f:
                json.dump(asdict(costs), f)
    if args.free_looks:
        costs = costs.free_looks()
    report(records, costs, args.replays, args.seeds, args.noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
