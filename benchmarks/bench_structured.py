#!/usr/bin/env python
"""Structured output under speculation (issue 28): a JSON-schema workload on the bundled pair, speculative
decoding with the grammar against plain decoding with the same grammar (the same llguidance masks, the same
kernels), interleaved repeats, medians; plus the grammar's host cost per token against a target pass.

Each call decodes every prompt as a batch of one (the latency case), greedy or seeded sampling at T = 0.8.
Times are the calls' prefill + decode (``stats.total_time``: not the per-call set-up, identical on both
sides). The mask cost is the time spent in the grammar's host work (grammar.RowGrammar.fill_chain, .commit and the
dead-end check, and a draft model's masks, RowGrammar.draft_column), timed by wrapping them, per emitted token, next to a plain target pass (plain decoding's
time per token without a grammar).

"spec+grammar, draft unprocessed" is the same speculative run with the drafter proposing from its unprocessed
logits (``ProcessingState.apply_draft_step`` made the identity for the run): what masking the drafts buys.
``--draft eagle`` drafts with the bundled EAGLE-3 head instead of the draft model.

    python benchmarks/bench_structured.py [--prompts 6] [--max-new-tokens 96] [--repeats 3] [--threads 1] [--draft eagle]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import specdec_ext
from specdec_ext import grammar as grammar_module
from specdec_ext.processing import ProcessingState
from specdec_ext.bench.workloads import code_prompts

SCHEMA = {"type": "object", "properties": {
    "function": {"type": "string", "maxLength": 24},
    "arguments": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "returns": {"enum": ["int", "str", "list", "dict", "None"]},
    "complexity": {"type": "integer"},
    "pure": {"type": "boolean"}},
    "required": ["function", "arguments", "returns", "complexity", "pure"], "additionalProperties": False}


class HostClock:
    """Seconds spent inside the grammar's host methods (wrapped for the run)."""

    METHODS = ("fill_chain", "fill_tree", "draft_column", "commit", "is_dead_end")

    def __init__(self):
        self.seconds = 0.0
        self.originals = {name: getattr(grammar_module.RowGrammar, name) for name in self.METHODS}

    def __enter__(self):
        for name, original in self.originals.items():
            setattr(grammar_module.RowGrammar, name, self._timed(original))
        return self

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(grammar_module.RowGrammar, name, original)

    def _timed(self, original):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return run


@contextlib.contextmanager
def unprocessed_drafts():
    """The drafters propose from their unprocessed logits (the baseline of what processing the drafts buys)."""
    original = ProcessingState.apply_draft_step
    ProcessingState.apply_draft_step = lambda self, logits, drafted, temperature, counts: logits
    try:
        yield
    finally:
        ProcessingState.apply_draft_step = original


def run_once(prompts, *, speculative: bool, grammar: bool, sampled: bool, max_new_tokens: int, draft=None,
             processed_drafts: bool = True) -> dict:
    """One pass over the prompts (batch 1 each): tokens, seconds, target passes, grammar host seconds, drafts
    reached and accepted."""
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=None)
    if grammar:
        kw["json_schema"] = SCHEMA
    if sampled:
        kw.update(temperature=0.8, seed=1)
    tokens = passes = reached = accepted = 0
    seconds = 0.0
    valid = 0
    with HostClock() as clock, (contextlib.nullcontext() if processed_drafts else unprocessed_drafts()):
        for prompt in prompts:
            result = (specdec_ext.generate([prompt], None, draft, k=4, **kw) if speculative
                      else specdec_ext.plain_generate([prompt], **kw))
            seconds += result.stats.total_time  # prefill and decode (not the call's set-up, not the probes)
            tokens += len(result.token_ids[0])
            passes += result.stats.steps
            reached += sum(result.stats.reached)
            accepted += sum(result.stats.accepted)
            if grammar:
                try:
                    json.loads(result.text[0])
                    valid += 1
                except ValueError:
                    pass
    return dict(tokens=tokens, seconds=seconds, passes=passes, host=clock.seconds, valid=valid,
                acceptance=accepted / reached if reached else float("nan"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft", choices=["model", "eagle"], default="model",
                        help="the bundled draft model (default) or the bundled EAGLE-3 head")
    args = parser.parse_args()
    draft = "eagle" if args.draft == "eagle" else None
    torch.set_num_threads(args.threads)
    prompts = [p + "\n# its signature as JSON: " for p in code_prompts(args.prompts, 8)]
    specdec_ext.generate(prompts[:1], None, draft, max_new_tokens=8, json_schema=SCHEMA)  # load, compile, warm up
    print(f"bundled pair ({'EAGLE-3 head' if draft else 'draft model'}), {len(prompts)} prompts, batch 1, "
          f"{args.max_new_tokens} new tokens at most, "
          f"{args.threads} thread(s), ISA {specdec_ext.ops.cpu_isa()}, torch {torch.__version__}")
    for sampled in (False, True):
        unprocessed = "spec+grammar, draft unprocessed"
        runs = {name: [] for name in ("plain", "plain+grammar", "spec+grammar", unprocessed)}
        for _ in range(args.repeats):  # interleaved
            common = dict(sampled=sampled, max_new_tokens=args.max_new_tokens)
            runs["plain"].append(run_once(prompts, speculative=False, grammar=False, **common))
            runs["plain+grammar"].append(run_once(prompts, speculative=False, grammar=True, **common))
            runs["spec+grammar"].append(run_once(prompts, speculative=True, grammar=True, draft=draft, **common))
            runs[unprocessed].append(run_once(prompts, speculative=True, grammar=True, draft=draft,
                                              processed_drafts=False, **common))
        label = "T=0.8 seed 1" if sampled else "greedy"
        rate = {name: statistics.median(r["tokens"] / r["seconds"] for r in rs) for name, rs in runs.items()}
        target_pass = statistics.median(r["seconds"] / r["passes"] for r in runs["plain"])
        print(f"\n{label}: {'run':<32} {'tok/s':>8} {'tokens/pass':>12} {'acceptance':>11} {'grammar host/token':>19} "
              f"{'vs a target pass':>17} {'valid JSON':>11}")
        for name, rs in runs.items():
            per_pass = statistics.median(r["tokens"] / r["passes"] for r in rs)
            host = statistics.median(r["host"] / r["tokens"] for r in rs)
            acceptance = statistics.median(r["acceptance"] for r in rs)
            valid = f"{rs[0]['valid']}/{len(prompts)}" if "grammar" in name else "-"
            print(f"{'':>{len(label) + 1}} {name:<32} {rate[name]:>8.1f} {per_pass:>12.2f} {acceptance:>11.3f} "
                  f"{host * 1e6:>16.1f} us {host / target_pass:>16.1%} {valid:>11}")
        print(f"{'':>{len(label) + 1}} speculative / plain under the grammar: "
              f"{rate['spec+grammar'] / rate['plain+grammar']:.2f}x (drafts unprocessed: "
              f"{rate[unprocessed] / rate['plain+grammar']:.2f}x); a plain target pass {target_pass * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
