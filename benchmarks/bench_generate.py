#!/usr/bin/env python
"""Side-by-side generation benchmark (also ``specdec bench``).

On one (target, draft) pair and the same prompts, in one run, batch 1, greedy:

* HF plain greedy ``generate``                         (the reference output and the speedup baseline)
* HF assisted generation (``assistant_model=draft``)
* HF prompt lookup (``prompt_lookup_num_tokens``)
* ours, plain decoding (k = 0: the same runner and sampler without a draft; the cost model's unit)
* ours, speculative, at each k of --ks (default 2, 4, 6)

Columns: tokens/s (median over repeats of the total tokens / total time over the prompts), speedup
over HF plain, tokens per target pass (new tokens / target forward calls, prefill included), and
whether every output is identical to HF plain greedy. The methods are interleaved within each repeat
(repeat -> method -> prompt) so that load drifting on a shared machine hits them alike.

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
from typing import Dict, List

import torch

DEFAULT_KS = (2, 4, 6)
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


class PassCounter:
    """Counts forward calls of a model (target passes)."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def parse_args(argv):
    p = argparse.ArgumentParser(prog="specdec bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target model path/id (default: the bundled pair; give --draft too)")
    p.add_argument("--draft", help="draft model path/id (default: the bundled pair)")
    p.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)), help="our draft lengths (default: 2,4,6)")
    p.add_argument("--prompts", type=int, default=3, help="held-out prompts (default: 3)")
    p.add_argument("--lines", type=int, default=20, help="lines of each held-out file per prompt (default: 20)")
    p.add_argument("--prompt-file", action="append", default=[], help="a file whose content is one prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt (default: 96)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats; medians are reported (default: 3)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default: 1; small models on a shared CPU run fastest on one)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                   help="dtype of both models, for every method (default: bfloat16, the bundled pair's stored "
                   "dtype; in fp32 a one-thread CPU is compute-bound and verifying k+1 tokens costs more)")
    p.add_argument("--runner", default="auto", choices=["auto", "paged", "recompute"], help="our model runner")
    p.add_argument("--confidence", type=float, default=0.0,
                   help="our drafter stops a row's draft after a token it gives probability below this "
                   "(like HF's assistant_confidence_threshold); 0 = always k (default: 0)")
    p.add_argument("--no-hf", action="store_true", help="skip the three HF baselines (ours only)")
    return p.parse_args(argv)


def load(args):
    from specdec_ext.generate import load_pair

    dtype = getattr(torch, args.dtype)
    if args.target is None and args.draft is None:
        from specdec_ext.default_pair import load_default_pair

        return load_default_pair(dtype=dtype)
    target, draft, tokenizer = load_pair(args.target, args.draft)
    return target.to(dtype), draft.to(dtype), tokenizer


def prompts_of(args, tokenizer) -> List[List[int]]:
    texts = []
    for path in args.prompt_file:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    if not texts:
        from specdec_ext.cli import heldout_prompts

        texts = [text for _, text in heldout_prompts(args.prompts, args.lines)]
    return [tokenizer(t)["input_ids"] for t in texts]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    from specdec_ext.generate import generate, plain_generate
    from specdec_ext.stats import expected_tokens_per_pass, predicted_speedup

    target, draft, tokenizer = load(args)
    prompts = prompts_of(args, tokenizer)
    ks = [int(x) for x in args.ks.split(",") if x.strip()]
    new = args.max_new_tokens
    eos = target.generation_config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    counter = PassCounter(target)

    def hf(prompt, **kw):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                  pad_token_id=pad, **kw)
        return out[0, len(prompt):].tolist(), None

    def ours_plain(prompt):
        r = plain_generate([prompt], target, tokenizer=tokenizer, max_new_tokens=new, runner=args.runner)
        return r.token_ids[0], r.stats

    def ours(k):
        def run(prompt):
            r = generate([prompt], target, draft, tokenizer=tokenizer, max_new_tokens=new, k=k, runner=args.runner,
                         cost_probe=False, draft_confidence=args.confidence)
            return r.token_ids[0], r.stats
        return run

    methods: Dict[str, callable] = {}
    if not args.no_hf:
        methods["HF plain greedy"] = lambda p: hf(p)
        methods["HF assisted (draft)"] = lambda p: hf(p, assistant_model=draft)
        methods[f"HF prompt lookup ({PROMPT_LOOKUP_TOKENS})"] = lambda p: hf(p, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
    methods["ours plain (k=0)"] = ours_plain
    for k in ks:
        methods[f"ours k={k}"] = ours(k)

    print(f"pair: target {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M, draft "
          f"{sum(p.numel() for p in draft.parameters()) / 1e6:.1f}M params, {args.dtype}, {args.threads} thread(s); "
          f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens, {new} new tokens, batch 1, greedy, "
          f"{args.repeats} repeats", flush=True)
    for name, run in methods.items():  # warm-up
        old = new
        new = WARMUP_TOKENS
        run(prompts[0])
        new = old
    results = {name: Measure() for name in methods}
    for rep in range(args.repeats):
        for name, run in methods.items():
            m = results[name]
            total_time, total_tokens, outputs = 0.0, 0, []
            counter.calls = 0
            for prompt in prompts:
                start = time.perf_counter()
                tokens, stats = run(prompt)
                total_time += time.perf_counter() - start
                total_tokens += len(tokens)
                outputs.append(tokens)
                if stats is not None:
                    m.stats.append(stats)
            m.times.append(total_time)
            m.tokens.append(total_tokens)
            m.passes.append(counter.calls)
            m.outputs = outputs
        print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr, flush=True)

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

    if "HF assisted (draft)" in results:
        assisted = results["HF assisted (draft)"].tokens_per_s
        best_k = max(ks, key=lambda k: results[f"ours k={k}"].tokens_per_s)
        best = results[f"ours k={best_k}"].tokens_per_s
        pred, meas = summary[best_k]
        print(f"\ntargets: ours (best k={best_k}) / HF assisted = {best / assisted:.2f}x (goal >= 1.5x); "
              f"measured / predicted decode speedup at k={best_k} = {meas / pred:.3f} (goal within 10%)")
    counter.handle.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
