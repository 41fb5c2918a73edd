"""Side-by-side generation benchmark: ``specdec bench`` (also ``python benchmarks/bench_generate.py``).

On one (target, draft) pair and the same prompts, in one run, batch 1, greedy, per workload:

* HF plain greedy ``generate``                         (the reference output and the speedup baseline)
* HF assisted generation (``assistant_model=draft``)   (the baseline of our draft-model rows)
* HF prompt lookup (``prompt_lookup_num_tokens``)      (the baseline of our lookup rows)
* ours, plain decoding (k = 0: the same runner and sampler without a draft; the cost model's unit)
* ours, each drafter of --drafters:
  model   the draft model as a chain, at each k of --ks (default 2, 4, 6, 8)
  ngram   suffix-automaton lookup over the prompt and output, at each k of --ngram-ks (default 4, 8)
  tree    draft-model trees (b, d, N) of --trees (default 2,3,6)
  heads   the bundled target's Medusa-style heads, trees of --heads-trees (default 3,3,8; bundled target only)
  eagle   the bundled target's EAGLE-3 head: a chain at each k of --eagle-ks (default 4) and trees of
          --heads-trees (bundled target only)
  auto    k="auto" for the model and the ngram drafter (next to their best fixed k)

Workloads (bench/workloads.py, --workloads, default code,edit): held-out code completion, and an
edit (a held-out function, then a request to write it again with one identifier renamed), where
lookup should shine. --prompt-file replaces them with one workload of your files.

Columns: tokens/s (median over repeats of the total tokens / total time over the prompts), speedup
over HF plain, tokens per target pass (new tokens / target forward calls, prefill included), and
whether every output is identical to HF plain greedy. The methods are interleaved within each repeat
(repeat -> method -> prompt), in reverse order every other repeat, so that load drifting on a shared
machine, and the position of a method in the order, hit them alike.

For ours at each k the cost model is checked: from the measured acceptance a, draft cost c and verify
cost v (per step, relative to a step of our plain decoding) the predicted decode speedup
E / (v + k c), E = (1 - a^(k+1)) / (1 - a), next to the measured decode speedup over our plain decoding.

Prompts: the first --lines lines of held-out files of the bundled pair (files it never trained on),
or --prompt-file. Default pair: the bundled one; --target/--draft for your own.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from ..arg_types import at_least, below_one, device, int_list, read_text_option, subset_of, tree_list
from ..cost_model import expected_tokens_per_pass, predicted_speedup
from ..plan import loop_cache_len
from ..plots import BenchPanel, BenchPoint, check_plot_option, pair_label, plot_bench, write_plot
from ..progress import hf_progress_bars_off, progress_bar, progress_wanted
from .workloads import WORKLOADS, workload_prompts

DEFAULT_KS = (2, 4, 6, 8)
DEFAULT_NGRAM_KS = (4, 8)
DEFAULT_TREES = "2,3,6"
DEFAULT_HEADS_TREES = "3,3,8"
DRAFTERS = ("model", "ngram", "tree", "heads", "eagle", "auto")
DEFAULT_EAGLE_KS = (4,)
GOAL_VS_ASSISTED = 1.5
GOAL_LOOKUP_VS_HF = 1.3
GOAL_AUTO_VS_BEST = 0.95
PROMPT_LOOKUP_TOKENS = 10  # HF's prompt_lookup_num_tokens (its documented typical value)
WARMUP_TOKENS = 8


@dataclass
class Measure:
    times: List[float] = field(default_factory=list)  # per repeat: seconds over all prompts
    tokens: List[int] = field(default_factory=list)  # per repeat: new tokens over all prompts
    passes: List[int] = field(default_factory=list)  # per repeat: target forward calls
    outputs: List[List[int]] = field(default_factory=list)  # last repeat: new tokens per prompt
    stats: list = field(default_factory=list)  # ours: GenerationStats of every run

    @property
    def tokens_per_s(self) -> float:
        return statistics.median(t / s for t, s in zip(self.tokens, self.times))

    @property
    def tokens_per_pass(self) -> float:
        return sum(self.tokens) / max(sum(self.passes), 1)


@dataclass(frozen=True)
class PlotPlace:
    """Where a method goes in --plot: a point of its drafter's curve at k draft tokens per step (a tree:
    its node count; None: adaptive, placed at the mean k it chose), or a reference line (curve None)."""

    curve: Optional[str] = None
    k: Optional[int] = None


REFERENCE = PlotPlace()


class PassCounter:
    """Counts forward calls of a model (target passes) for the HF baselines; our runs count their
    passes in their stats (``passes_of``: the lean target runner does not call the module)."""

    def __init__(self, model):
        self.calls = 0

        def count(*_):
            self.calls += 1
        count.specdec_internal = True  # (runners/lean.py: our own runs do not call the module)
        self.handle = model.register_forward_hook(count)


def passes_of(stats_list) -> int:
    """Target passes of our generations: the prefill plus one per decode step (no cost probe)."""
    return sum(s.steps + 1 for s in stats_list)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="specdec bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model path/id (default: the bundled pair; give --draft too)")
    p.add_argument("--draft", help="draft model path/id (default: the bundled pair)")
    p.add_argument("--ks", type=int_list, default=list(DEFAULT_KS), help="our draft lengths (default: 2,4,6,8)")
    p.add_argument("--drafters", type=subset_of(DRAFTERS), default=list(DRAFTERS),
                   help=f"our drafters besides the model chain at --ks (default: {','.join(DRAFTERS)})")
    p.add_argument("--ngram-ks", type=int_list, default=list(DEFAULT_NGRAM_KS),
                   help="draft lengths of the lookup drafter (default: 4,8)")
    p.add_argument("--trees", type=tree_list, default=tree_list(DEFAULT_TREES), help="draft-model trees b,d,N separated by ';' (default: 2,3,6)")
    p.add_argument("--heads-trees", type=tree_list, default=tree_list(DEFAULT_HEADS_TREES),
                   help="heads trees b,d,N separated by ';' (default: 3,3,8)")
    p.add_argument("--eagle-ks", type=int_list, default=list(DEFAULT_EAGLE_KS),
                   help="chain lengths of the EAGLE-3 head (default: 4)")
    p.add_argument("--workloads", type=subset_of(WORKLOADS), default=list(WORKLOADS),
                   help="subset of code,edit (default: code,edit)")
    p.add_argument("--prompts", type=at_least(1), default=3, help="held-out prompts per workload (default: 3)")
    p.add_argument("--lines", type=at_least(1), default=20, help="lines of each held-out file per prompt (default: 20)")
    p.add_argument("--prompt-file", action="append", default=[], help="a file whose content is one prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=96, help="new tokens per prompt (default: 96)")
    p.add_argument("--repeats", type=at_least(1), default=3, help="timed repeats; medians are reported (default: 3)")
    p.add_argument("--threads", type=at_least(1), default=1,
                   help="torch CPU threads (default: 1; small models on a shared CPU run fastest on one)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype of both models, for every method (default: bfloat16, the bundled pair's stored "
                   "dtype; in fp32 a one-thread CPU is compute-bound and verifying k+1 tokens costs more)")
    p.add_argument("--runner", default="auto", choices=["auto", "lean", "paged", "recompute"], help="our model runner")
    p.add_argument("--device", type=device, default="cpu", help="where both models run, e.g. cuda (default: cpu)")
    p.add_argument("--confidence", type=below_one, default=0.0,
                   help="our drafter stops a row's draft after a token it gives probability below this "
                   "(like HF's assistant_confidence_threshold); 0 = always k (default: 0)")
    p.add_argument("--no-hf", action="store_true", help="skip the three HF baselines (ours only)")
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw tokens/s and tokens per pass against k for each drafter, the HF methods and "
                   'ours plain as horizontal lines, one row per workload (needs matplotlib: pip install ".[plot]")')
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars (they go to stderr, and only when it is a terminal)")
    return p.parse_args(argv)


def load(args):
    from ..models import cast_model, load_pair

    dtype = getattr(torch, args.dtype)
    device = getattr(args, "device", "cpu")
    if args.target is None and args.draft is None:
        from ..default_pair import load_default_pair

        return load_default_pair(dtype=dtype, device=device)
    target, draft, tokenizer = load_pair(args.target, args.draft)
    return cast_model(target, dtype).to(device), cast_model(draft, dtype).to(device), tokenizer


def workloads_of(args, tokenizer) -> Dict[str, List[List[int]]]:
    """{workload: prompt token lists}: --prompt-file as one workload "files", else --workloads."""
    if args.prompt_file:
        texts = [read_text_option("--prompt-file", path) for path in args.prompt_file]
        return {"files": [tokenizer(t)["input_ids"] for t in texts]}
    return {w: [tokenizer(t)["input_ids"] for t in workload_prompts(w, args.prompts, args.lines)]
            for w in args.workloads}


def _check_draft_lengths(args, target, workloads, lengths: Dict[str, List[int]]) -> None:
    """ValueError naming the option for a draft length whose chain does not fit the target's positions with the
    longest prompt and --max-new-tokens (the plan would refuse it, in its own terms, only when it comes up)."""
    config = target.config  # (an HF model's)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return
    longest = max((len(p) for prompts in workloads.values() for p in prompts), default=0)
    new = max(args.max_new_tokens, WARMUP_TOKENS)
    for option, ks in lengths.items():
        for k in ks:
            needed = loop_cache_len(longest, new, k)
            if needed > limit:
                raise ValueError(f"{option} {k}: a chain of {k} drafts needs {needed} cache positions for the longest "
                                 f"prompt ({longest} tokens) and {new} new tokens (the larger of --max-new-tokens "
                                 f"{args.max_new_tokens} and the warm-up's {WARMUP_TOKENS}), past the target's {limit} "
                                 f"(max_position_embeddings): lower {option}")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    check_plot_option("bench", args.plot)
    torch.set_num_threads(args.threads)
    with hf_progress_bars_off(not progress_wanted(args.quiet)):
        target, draft, tokenizer = load(args)
    workloads = workloads_of(args, tokenizer)
    drafters = set(args.drafters)
    for bundled in ("heads", "eagle"):
        if bundled in drafters and args.target is not None:
            print(f"({bundled} rows skipped: the bundled {bundled} head(s) belong to the bundled target)", flush=True)
            drafters.discard(bundled)
    ks = args.ks
    ngram_ks = args.ngram_ks if "ngram" in drafters else []
    _check_draft_lengths(args, target, workloads, {"--ks": ks, "--ngram-ks": ngram_ks,
                                                   "--eagle-ks": args.eagle_ks if "eagle" in drafters else []})
    counter = PassCounter(target)
    print(f"pair: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, draft "
          f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M params, {args.dtype}, {args.threads} thread(s); "
          f"{args.max_new_tokens} new tokens, batch 1, greedy, {args.repeats} repeats", flush=True)
    panels: List[BenchPanel] = []
    for workload, prompts in workloads.items():
        print(f"\n=== workload {workload}: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens", flush=True)
        methods, places = build_methods(args, target, draft, tokenizer, drafters, ks, ngram_ks)
        results = run_methods(methods, prompts, counter, args, description=f"bench {workload}")
        report(results, ks, ngram_ks)
        count = f"{len(prompts)} prompt{'s' if len(prompts) != 1 else ''}"
        panels.append(bench_panel(f"{workload} ({count})", results, places))
    counter.handle.remove()
    if args.plot:
        details = (f"{args.dtype}, {args.max_new_tokens} new tokens, batch 1, greedy, median of {args.repeats} "
                   f"repeat{'s' if args.repeats != 1 else ''}")
        write_plot("bench", lambda: plot_bench(panels, args.plot, pair=pair_label(target, draft), details=details))
    return 0


def build_methods(args, target, draft, tokenizer, drafters, ks, ngram_ks):
    """({row name: prompt tokens -> (new tokens, GenerationStats or None)}, {row name: PlotPlace}); new
    tokens from args.new."""
    from ..generate import generate, plain_generate

    eos = target.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    heads = None
    if "heads" in drafters:
        from ..default_pair import load_default_heads
        param = next(target.parameters())
        heads = load_default_heads(dtype=param.dtype, device=param.device)

    def hf(**kw):
        def run(prompt):
            ids = torch.tensor([prompt], device=next(target.parameters()).device)
            with torch.no_grad():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=args.new, pad_token_id=pad, **kw)
            return out[0, len(prompt):].tolist(), None
        return run

    def ours_plain(prompt):
        r = plain_generate([prompt], target, tokenizer=tokenizer, max_new_tokens=args.new, runner=args.runner)
        return r.token_ids[0], r.stats

    def ours(draft_spec, **kw):
        def run(prompt):
            r = generate([prompt], target, draft_spec, tokenizer=tokenizer, max_new_tokens=args.new,
                         runner=args.runner, cost_probe=False, **kw)
            return r.token_ids[0], r.stats
        return run

    methods: Dict[str, callable] = {}
    places: Dict[str, PlotPlace] = {}

    def add(name, run, place=REFERENCE):
        methods[name], places[name] = run, place

    if not args.no_hf:
        add("HF plain greedy", hf())
        add("HF assisted (draft)", hf(assistant_model=draft))
        add(f"HF prompt lookup ({PROMPT_LOOKUP_TOKENS})", hf(prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS))
    add("ours plain (k=0)", ours_plain)
    for k in ks:
        add(f"ours k={k}", ours(draft, k=k, draft_confidence=args.confidence), PlotPlace("ours draft model", k))
    if "auto" in drafters:
        add("ours k=auto", ours(draft, k="auto"), PlotPlace("ours draft model k=auto"))
    for k in ngram_ks:
        add(f"ours ngram k={k}", ours("ngram", k=k), PlotPlace("ours ngram", k))
    if "ngram" in drafters and "auto" in drafters:
        add("ours ngram k=auto", ours("ngram", k="auto"), PlotPlace("ours ngram k=auto"))
    if "tree" in drafters:
        for tree in args.trees:
            add(f"ours tree {','.join(map(str, tree))}", ours(draft, draft_tree=tree),
                PlotPlace("ours draft-model trees (b,d,N)", tree[2]))
    if heads is not None:
        for tree in args.heads_trees:
            add(f"ours heads {','.join(map(str, tree))}", ours(heads, draft_tree=tree),
                PlotPlace("ours heads trees (b,d,N)", tree[2]))
    if "eagle" in drafters:
        from ..default_pair import load_default_eagle
        from ..eagle import EagleDrafterSpec
        eagle = EagleDrafterSpec(load_default_eagle(target))
        for k in args.eagle_ks:
            add(f"ours eagle k={k}", ours(eagle, k=k), PlotPlace("ours EAGLE-3", k))
        for tree in args.heads_trees:
            add(f"ours eagle tree {','.join(map(str, tree))}", ours(eagle, draft_tree=tree),
                PlotPlace("ours EAGLE-3 trees (b,d,N)", tree[2]))
    return methods, places


def bench_panel(workload: str, results: Dict[str, Measure], places: Dict[str, PlotPlace]) -> BenchPanel:
    """The --plot panel of one workload: each method at its PlotPlace."""
    panel = BenchPanel(workload)
    for name, m in results.items():
        place = places[name]
        if place.curve is None:
            panel.references[name] = BenchPoint(None, m.tokens_per_s, m.tokens_per_pass)
            continue
        k = place.k if place.k is not None else statistics.mean(s.adaptive["mean_row_k"] for s in m.stats)
        panel.curves.setdefault(place.curve, []).append(BenchPoint(k, m.tokens_per_s, m.tokens_per_pass))
    return panel


def run_methods(methods, prompts, counter, args, description: str = "bench") -> Dict[str, Measure]:
    """Warm up every method, then the timed repeats, interleaved (repeat -> method -> prompt); a progress
    bar on stderr counts the method runs (hidden when stderr is not a terminal or with args.quiet)."""
    bar = progress_bar(len(methods) * (1 + args.repeats), description, unit="run",
                       show=progress_wanted(getattr(args, "quiet", False)))
    args.new = WARMUP_TOKENS
    bar.set_postfix_str("warm-up", refresh=False)
    for run in methods.values():
        run(prompts[0])
        bar.update()
    args.new = args.max_new_tokens
    results = {name: Measure() for name in methods}
    for rep in range(args.repeats):
        bar.set_postfix_str(f"repeat {rep + 1}/{args.repeats}", refresh=False)
        order = list(methods.items())
        for name, run in (order if rep % 2 == 0 else order[::-1]):  # a method's place in the order is not its cost
            m = results[name]
            total_time, total_tokens, outputs = 0.0, 0, []
            counter.calls = 0
            repeat_stats = []
            for prompt in prompts:
                start = time.perf_counter()
                tokens, stats = run(prompt)
                total_time += time.perf_counter() - start
                total_tokens += len(tokens)
                outputs.append(tokens)
                if stats is not None:
                    repeat_stats.append(stats)
            m.stats.extend(repeat_stats)
            m.times.append(total_time)
            m.tokens.append(total_tokens)
            m.passes.append(passes_of(repeat_stats) if repeat_stats else counter.calls)
            m.outputs = outputs
            bar.update()
    bar.close()
    return results


def report(results: Dict[str, Measure], ks, ngram_ks) -> None:
    """The side-by-side table, the cost-model check of the model chain, and the targets."""
    reference_name = "HF plain greedy" if "HF plain greedy" in results else "ours plain (k=0)"
    reference = results[reference_name]
    print(f"\n{'method':<26} {'tok/s':>8} {'speedup':>8} {'tok/pass':>9} {'identical':>10}")
    for name, m in results.items():
        same = "yes" if m.outputs == reference.outputs else "NO"
        print(f"{name:<26} {m.tokens_per_s:>8.1f} {m.tokens_per_s / reference.tokens_per_s:>7.2f}x "
              f"{m.tokens_per_pass:>9.2f} {same:>10}")

    plain_stats = results["ours plain (k=0)"].stats
    plain_step = sum(s.decode_time for s in plain_stats) / sum(s.steps for s in plain_stats)
    print(f"\ncost model (units: one step of our plain decoding = {plain_step * 1e3:.2f} ms; decode phase only)")
    print(f"{'k':>3} {'a':>6} {'c':>6} {'v':>6} {'E pred':>7} {'E meas':>7} {'pred':>7} {'meas':>7} {'meas/pred':>9}")
    summary = {}
    for k in ks:
        runs = results[f"ours k={k}"].stats
        steps = sum(s.steps for s in runs)
        a = sum(sum(s.accepted) for s in runs) / max(sum(sum(s.reached) for s in runs), 1)
        c = sum(s.draft_time for s in runs) / steps / k / plain_step
        v = sum(s.verify_time for s in runs) / steps / plain_step
        e_meas = sum(s.emitted for s in runs) / sum(s.row_steps for s in runs)
        pred = predicted_speedup(a, k, c, v)
        meas = sum(s.new_tokens - s.batch_size for s in runs) / sum(s.decode_time for s in runs) * plain_step
        summary[k] = (pred, meas)
        print(f"{k:>3} {a:>6.3f} {c:>6.3f} {v:>6.3f} {expected_tokens_per_pass(a, k):>7.2f} {e_meas:>7.2f} "
              f"{pred:>6.2f}x {meas:>6.2f}x {meas / pred:>9.3f}")

    rate = {name: m.tokens_per_s for name, m in results.items()}
    lines = []
    if ks:
        best_k = max(ks, key=lambda k: rate[f"ours k={k}"])
        best = rate[f"ours k={best_k}"]
        pred, meas = summary[best_k]
        if "HF assisted (draft)" in rate:
            lines.append(f"ours (best k={best_k}) / HF assisted = {best / rate['HF assisted (draft)']:.2f}x "
                         f"(goal >= {GOAL_VS_ASSISTED}x)")
        lines.append(f"measured / predicted decode speedup at k={best_k} = {meas / pred:.3f} (goal within 10%)")
        if "ours k=auto" in rate:
            lines.append(f"ours k=auto / best fixed k (k={best_k}) = {rate['ours k=auto'] / best:.3f} "
                         f"(goal >= {GOAL_AUTO_VS_BEST})")
    if ngram_ks:
        best_n = max(ngram_ks, key=lambda k: rate[f"ours ngram k={k}"])
        best = rate[f"ours ngram k={best_n}"]
        lookup = [name for name in rate if name.startswith("HF prompt lookup")]
        if lookup:
            lines.append(f"ours ngram (best k={best_n}) / HF prompt lookup = {best / rate[lookup[0]]:.2f}x "
                         f"(goal >= {GOAL_LOOKUP_VS_HF}x on the edit workload)")
        if "ours ngram k=auto" in rate:
            lines.append(f"ours ngram k=auto / best fixed ngram k (k={best_n}) = "
                         f"{rate['ours ngram k=auto'] / best:.3f} (goal >= {GOAL_AUTO_VS_BEST})")
    print("\ntargets:\n" + "\n".join("  " + line for line in lines))

