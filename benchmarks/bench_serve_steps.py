#!/usr/bin/env python
"""The serving engine's steps in-process, speculative against plain: where a step's time goes (issue 30).

bench_serve.py measures the servers over HTTP, where a client's share of the host and the event loop sit
between the steps. This runs the same engine (serve/build.py ``build_engine``, the server's plan: CUDA
graphs by bucket on a GPU, chunked prefill on the CPU) without HTTP: ``--requests`` greedy requests of
``--prompt-tokens`` tokens and ``--max-tokens`` new ones (no EOS stop) are submitted at once to
``--slots`` slots after ``Engine.calibrate``, and every step of the batcher is timed and sorted by kind
(drafting or plain, with or without prompt chunks). The speculative server's own host work is timed
apart: the draft length's ``choose`` / ``observe`` / ``record_joins``, the device steps' page
reservations and read-backs (``Stepper._reserve`` / ``_hand_back``: both servers under graphs), the
drafter's holds of joining rows. Modes alternate over ``--repeats``; the ratio is of the wall times.

``--host-bound`` stands in for a GPU's regime on the CPU: the bundled draft model (2 layers, hidden 128)
as the target and a random model of its config as the draft (acceptance ~0, so k by load keeps
speculation off). A 32-row step then takes ~5 ms, the order of a replayed step on an H200 (2.5 ms), where
the bundled target's takes ~50: what the speculative server does besides the target's passes shows.

    python benchmarks/bench_serve_steps.py                       # this CPU, 32 slots
    python benchmarks/bench_serve_steps.py --host-bound --repeats 6
    python benchmarks/bench_serve_steps.py --device cuda         # CUDA graphs by bucket (gpu_check.sh)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections import defaultdict
from typing import Callable, Dict, List

MODES = ("speculative", "plain")
HOST_PARTS = ("choose", "observe", "record_joins", "reserve", "hand_back", "hold_rows")
SUBMIT_RETRY_S = 0.005  # a full queue (429) is retried after this


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where torch sees a GPU)")
    p.add_argument("--slots", type=int, default=32, help="the engine's max_rows (default: 32)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default: 2 x slots)")
    p.add_argument("--prompt-tokens", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="alternating runs of each mode (default: 2)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: 1, as specdec serve)")
    p.add_argument("--host-bound", action="store_true",
                   help="the bundled draft as the target, a random draft: steps of a few ms (module docstring)")
    return p.parse_args(argv)


def timed(obj, name: str, label: str, totals: Dict[str, float]) -> None:
    """Wrap ``obj.name`` so that its seconds add up in ``totals[label]``."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - begin

    setattr(obj, name, wrapper)


def build(mode: str, args, device):
    """The engine of ``mode`` (the bundled pair, or its target alone), calibrated, and its prompt."""
    from specdec_ext.bench.workloads import heldout_prompts
    from specdec_ext.cli import SERVE_CALIBRATION_TEXT
    from specdec_ext.models import load_models
    from specdec_ext.serve.build import EngineOptions, build_engine

    models = (host_bound(mode) if args.host_bound else load_models(plain=mode == "plain")).to(device)
    engine = build_engine(models, EngineOptions(max_rows=args.slots, max_queue=args.requests))
    engine.calibrate(models.tokenizer.encode(SERVE_CALIBRATION_TEXT))
    text = "\n".join(text for _, text in heldout_prompts(4, 40))  # (more than --prompt-tokens)
    prompt = models.tokenizer.encode(text)[: args.prompt_tokens]
    return engine, prompt


def host_bound(mode: str):
    """The bundled draft model as the target; for ``speculative`` a random model of its config as the draft
    (seeded: the same one every run)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec_ext.models import Models, load_models

    pair = load_models()
    small = pair.draft
    if mode == "plain":
        return Models(small, "none", tokenizer=pair.tokenizer)
    torch.manual_seed(0)
    random = AutoModelForCausalLM.from_config(small.config).to(small.dtype).eval()
    return Models(small, "model", draft=random, tokenizer=pair.tokenizer)


def instrument(engine, totals: Dict[str, float], steps: List[tuple]) -> None:
    """Time the engine's steps (into ``steps``: seconds, StepRecord or None) and its host parts."""
    batcher = engine.batcher
    if batcher.draft_length is not None:
        for name in ("choose", "observe", "record_joins"):
            timed(batcher.draft_length, name, name, totals)
    if batcher.drafter is not None:
        timed(batcher.drafter, "hold_rows", "hold_rows", totals)
    make_stepper = batcher._stepper_for
    instrumented = set()

    def stepper_for(*a, **k):
        stepper = make_stepper(*a, **k)
        if id(stepper) not in instrumented:  # (a Stepper per key, made once and kept by the batcher)
            instrumented.add(id(stepper))
            timed(stepper, "_reserve", "reserve", totals)
            timed(stepper, "_hand_back", "hand_back", totals)
        return stepper

    batcher._stepper_for = stepper_for
    step = batcher.step

    def timed_step():
        logged = len(batcher.step_log)
        begin = time.perf_counter()
        step()
        seconds = time.perf_counter() - begin
        steps.append((seconds, batcher.step_log[-1] if len(batcher.step_log) > logged else None))

    batcher.step = timed_step


def run(engine, prompt: List[int], args, sync: Callable[[], None]) -> float:
    """Submit every request at once, wait for all of them; wall seconds."""
    from specdec_ext.sampling import SamplingParams
    from specdec_ext.serve.request import GenerationRequest, RequestRejected
    from specdec_ext.stops import StopCriteria

    done = threading.Semaphore(0)

    def sink(event):
        if event.finished:
            done.release()

    engine.start()
    sync()
    begin = time.perf_counter()
    for i in range(args.requests):
        request = GenerationRequest(prompt=list(prompt), sampling=SamplingParams(), seed=i,
                                    stop=StopCriteria(max_new_tokens=args.max_tokens))
        while True:
            try:
                engine.submit(request, sink)
                break
            except RequestRejected:
                time.sleep(SUBMIT_RETRY_S)
    for _ in range(args.requests):
        done.acquire()
    sync()
    wall = time.perf_counter() - begin
    engine.stop()
    return wall


def kind_of(record) -> str:
    if record is None:
        return "no step"
    if record.width == 0:
        return "prefill only"
    return ("drafting" if record.k else "plain") + (" + chunk" if record.prefilled else "")


def report(mode: str, wall: float, steps: List[tuple], totals: Dict[str, float], tokens: int) -> None:
    by_kind = defaultdict(list)
    for seconds, record in steps:
        by_kind[kind_of(record)].append((seconds, record))
    count = max(len(steps), 1)
    print(f"{mode}: {wall:.2f} s, {tokens / wall:.0f} tokens/s, {len(steps)} steps; host parts per step: "
          + ", ".join(f"{name} {1e6 * totals[name] / count:.0f} us" for name in HOST_PARTS if totals[name]))
    for kind, rows in sorted(by_kind.items()):
        emitted = [sum(r.emitted.values()) for _, r in rows if r is not None]
        widths = [r.width for _, r in rows if r is not None]
        print(f"  {kind:<18} {len(rows):>5} steps  {1e3 * statistics.mean(s for s, _ in rows):>8.2f} ms each"
              f"  {statistics.mean(emitted) if emitted else 0:>6.1f} tokens  width {statistics.mean(widths) if widths else 0:>5.1f}"
              f"  {100 * sum(s for s, _ in rows) / wall:>5.1f}% of the wall")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    from _timing import machine_description, synchronize

    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.requests = args.requests or 2 * args.slots
    pair = "host-bound pair (the bundled draft as the target, a random draft)" if args.host_bound else "bundled pair"
    print(f"# in-process serving steps, {pair}, on {machine_description(device)}; {args.requests} requests of "
          f"{args.prompt_tokens} + {args.max_tokens} tokens into {args.slots} slots at once, after "
          f"Engine.calibrate; {args.repeats} alternating run(s) per mode")
    walls: Dict[str, List[float]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in (MODES if repeat % 2 == 0 else MODES[::-1]):
            engine, prompt = build(mode, args, device)
            totals: Dict[str, float] = defaultdict(float)
            steps: List[tuple] = []
            instrument(engine, totals, steps)
            wall = run(engine, prompt, args, lambda: synchronize(device))
            walls[mode].append(wall)
            report(mode, wall, steps, totals, args.requests * args.max_tokens)
    ratios = [p / s for s, p in zip(walls["speculative"], walls["plain"])]
    print(f"speculative / plain tokens/s: {statistics.median(ratios):.3f}x (median of {len(ratios)} pairs: "
          + ", ".join(f"{r:.3f}" for r in ratios) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
