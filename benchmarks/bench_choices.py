#!/usr/bin/env python
"""n choices of one request (issue 28) on the serving engine over the bundled pair: the request's n rows
admitted together (one prefill, the others fork its cache: Engine.submit_group) against the same n rows as
separate requests (each prefills the prompt), side by side, interleaved repeats, medians.

Per run: the prompt tokens prefilled, the most pages in use (paged runner) and shared, the time until every
choice has its first token (TTFT of the slowest choice) and until all are done. Both sides draw the same
tokens (the same seeds), which the script checks.

    python benchmarks/bench_choices.py [--n 4] [--prompt-tokens 600] [--max-new-tokens 32] [--repeats 3]
"""
from __future__ import annotations

import argparse
import queue
import statistics
import time
from typing import Dict, List

import torch

from specdec_ext.bench.workloads import code_prompts
from specdec_ext.models import load_models
from specdec_ext.sampling import SamplingParams
from specdec_ext.serve.app import choice_seed
from specdec_ext.serve.build import EngineOptions, build_engine
from specdec_ext.serve.request import GenerationRequest
from specdec_ext.stops import StopCriteria

EVENT_TIMEOUT_S = 600.0


class Sink:
    def __init__(self, clock):
        self.clock, self.events = clock, queue.Queue()
        self.tokens: List[int] = []
        self.first_at = None

    def __call__(self, event) -> None:
        if self.first_at is None and event.tokens:
            self.first_at = self.clock()
        self.events.put(event)

    def wait(self) -> List[int]:
        while True:
            event = self.events.get(timeout=EVENT_TIMEOUT_S)
            self.tokens += event.tokens
            if event.finished:
                return self.tokens


def _requests(prompt: List[int], n: int, max_new: int, shared: bool) -> List[GenerationRequest]:
    requests = [GenerationRequest(list(prompt), SamplingParams(1.0), choice_seed(7, c), StopCriteria(max_new, [], []))
                for c in range(n)]
    if shared:
        for request in requests[1:]:
            request.shares_prompt_with = requests[0].request_id
    return requests


def run(engine, prompt: List[int], n: int, max_new: int, shared: bool) -> Dict[str, float]:
    """One request of n choices (shared) or n separate requests on an idle engine."""
    target = engine.batcher.target
    fed = {"tokens": 0}
    start_rows = target.start_rows
    target.start_rows = lambda rows, prompts: fed.__setitem__("tokens", fed["tokens"] + sum(map(len, prompts))) \
        or start_rows(rows, prompts)
    peak = {"pages": 0, "shared": 0}
    step = engine.batcher.step

    def watched_step():
        step()
        kv = getattr(target, "kv", None)
        if kv is not None:
            peak["pages"] = max(peak["pages"], kv.num_pages - kv.num_free_pages)
            peak["shared"] = max(peak["shared"], kv.num_shared_pages)

    engine.batcher.step = watched_step
    requests = _requests(prompt, n, max_new, shared)
    sinks = [Sink(time.perf_counter) for _ in requests]
    begin = time.perf_counter()
    if shared:
        engine.submit_group(requests, sinks)
    else:
        for request, sink in zip(requests, sinks):
            engine.submit(request, sink)
    tokens = [sink.wait() for sink in sinks]
    done = time.perf_counter() - begin
    engine.batcher.step, target.start_rows = step, start_rows
    return {"prefilled": fed["tokens"], "pages": peak["pages"], "shared": peak["shared"],
            "ttft": max(s.first_at for s in sinks) - begin, "total": done, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runners", default="paged,lean")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = load_models()
    text = "\n".join(code_prompts(8, 40))
    prompt = models.tokenizer.encode(text)[: args.prompt_tokens]
    print(f"# bundled pair, n = {args.n}, a {len(prompt)}-token prompt, {args.max_new_tokens} new tokens at T = 1, "
          f"k = 4, {args.threads} thread(s); medians of {args.repeats}")
    print("| runner | choices | prompt tokens prefilled | most pages in use | pages shared | TTFT of the last choice (s) "
          "| all done (s) |")
    print("|---|---|---|---|---|---|---|")
    for runner in args.runners.split(","):
        engine = build_engine(models, EngineOptions(k=4, max_seq_len=len(prompt) + args.max_new_tokens + 16,
                                                    max_rows=args.n, runner=runner, prefill_chunk=0))
        engine.start()
        try:
            rows = {True: [], False: []}
            for _ in range(args.repeats):
                for shared in (True, False):
                    rows[shared].append(run(engine, prompt, args.n, args.max_new_tokens, shared))
        finally:
            engine.stop()
        assert rows[True][0]["tokens"] == rows[False][0]["tokens"], "the two sides drew different tokens"
        for shared in (True, False):
            runs = rows[shared]
            median = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
            label = "one request, shared prompt" if shared else "separate requests"
            pages = f"{median('pages'):.0f}" if runner == "paged" else "n/a (a row per slot)"
            print(f"| {runner} | {label} | {median('prefilled'):.0f} | {pages} | "
                  f"{median('shared'):.0f} | {median('ttft'):.3f} | {median('total'):.3f} |")


if __name__ == "__main__":
    main()
