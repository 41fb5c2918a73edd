"""The serving engine without HTTP: continuous batching gives every request what generate() gives it alone
(greedy and seeded, over the runners and drafters), whatever joins or leaves around it; cache admission
queues instead of overcommitting; cancellation, failures and shutdown free rows without touching others."""
from __future__ import annotations

import queue
import random
import threading
from typing import List, Optional

import pytest
import torch

from specdec_ext import generate, plain_generate
from specdec_ext.models import Models
from specdec_ext.sampling import SamplingParams
from specdec_ext.serve.build import EngineOptions, build_engine
from specdec_ext.serve.request import (ABORTED, CANCELLED, FAILED, GenerationRequest, QueueFullError,
                                       RequestTooLargeError, ShuttingDownError)
from specdec_ext.stops import StopCriteria
from serve_utils import Collector, slow_target, tiny_pair, wait_until

K = 3


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def _run_to_end(engine, requests) -> List[Collector]:
    """Queue ``requests`` on a stopped engine, run it until each has ended, stop it; their sinks."""
    sinks = [Collector() for _ in requests]
    for request, sink in zip(requests, sinks):
        engine.submit(request, sink)
    engine.start()
    try:
        for sink in sinks:
            sink.wait()
    finally:
        engine.stop()
    return sinks


def _engine(pair, drafter="model", **options):
    target, draft, tokenizer = pair
    models = Models(target, drafter, draft=draft if drafter == "model" else None, tokenizer=tokenizer)
    return build_engine(models, EngineOptions(k=K, max_seq_len=256, **options))


def _request(tokenizer, prompt: str, *, max_new: int, sampling=SamplingParams(), seed=0, eos=True, stop=()):
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return GenerationRequest(tokenizer(prompt)["input_ids"], sampling, seed,
                             StopCriteria(max_new, [0] if eos else [], list(stop), decode))


def _reference(pair, drafter, runner, request: GenerationRequest, prompt: str):
    """generate()'s tokens for the request alone (same k, runner, filter, seed, stops)."""
    target, draft, tokenizer = pair
    s, stop = request.sampling, request.stop
    kw = dict(max_new_tokens=stop.max_new_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
              seed=request.seed, eos_token_id=list(stop.eos_token_ids) or False, stop=list(stop.stop_strings) or None,
              tokenizer=tokenizer, runner=runner)
    if drafter == "none":
        return plain_generate([prompt], target, **kw).token_ids[0]
    spec = draft if drafter == "model" else "ngram"
    return generate([prompt], target, spec, k=K, **kw).token_ids[0]


PROMPTS = ["def fib(n):\n    return", "import os\nimport sys\n", "x = [1, 2, 3]\nprint(x", "a", "class a:\n  def",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n    print("]
FILTERS = [SamplingParams(), SamplingParams(0.8, 5, 0.9), SamplingParams(1.0), SamplingParams(1.3, 0, 0.5),
           SamplingParams(0.7, 20, 1.0), SamplingParams()]


@pytest.mark.parametrize("runner, drafter", [("auto", "model"), ("paged", "model"), ("recompute", "model"),
                                             ("auto", "ngram"), ("paged", "ngram"), ("auto", "none")])
def test_every_request_gets_what_generate_gives_it_alone(pair, runner, drafter):
    """Six requests with their own filters, seeds and stops through three slots: they join while others
    run (two at a time, after the running ones have decoded), wait for a slot, and reuse freed slots."""
    tokenizer = pair[2]
    engine = _engine(pair, drafter, runner=runner, max_rows=3)
    requests = [_request(tokenizer, p, max_new=12 + 5 * i, sampling=f, seed=100 + i, eos=i % 2 == 0,
                         stop=["):"] if i == 4 else ())
                for i, (p, f) in enumerate(zip(PROMPTS, FILTERS))]
    # (before the engine runs: the paged attention's step in flight is process-global, one forward at a time)
    references = [_reference(pair, drafter, runner, r, p) for r, p in zip(requests, PROMPTS)]
    engine.start()
    try:
        sinks = []
        for i in range(0, len(requests), 2):
            for request in requests[i: i + 2]:
                sinks.append(Collector())
                engine.submit(request, sinks[-1])
            sinks[-1].next()  # the newest request has its first token: the others decode meanwhile
        for sink in sinks:
            sink.wait()
    finally:
        engine.stop()
    assert [s.tokens for s in sinks] == references
    assert all(s.reason in ("eos", "length", "stop") for s in sinks)
    assert engine.batcher.budget.used == 0 and not engine.batcher.running


def test_a_seeded_request_returns_the_same_tokens_alone_and_among_15_others(pair):
    tokenizer = pair[2]
    probe = _request(tokenizer, "def fib(n):", max_new=40, sampling=SamplingParams(0.9, 10, 0.95), seed=7, eos=False)
    engine = _engine(pair, max_rows=16)
    engine.start()
    try:
        alone = Collector()
        engine.submit(probe, alone)
        alone.wait()
        rng = random.Random(3)
        others = [_request(tokenizer, rng.choice(PROMPTS), max_new=rng.randint(5, 60), sampling=rng.choice(FILTERS),
                           seed=rng.randrange(1000), eos=rng.random() < 0.5) for _ in range(15)]
        sinks = [Collector() for _ in others]
        for request, sink in zip(others[:7], sinks[:7]):  # seven already run when the probe joins
            engine.submit(request, sink)
        sinks[6].next()
        together = Collector()
        engine.submit(GenerationRequest(probe.prompt, probe.sampling, probe.seed, probe.stop), together)
        for request, sink in zip(others[7:], sinks[7:]):
            engine.submit(request, sink)
        together.wait()
        for sink in sinks:
            assert sink.wait().reason in ("eos", "length")
    finally:
        engine.stop()
    assert len(alone.tokens) == 40
    assert together.tokens == alone.tokens == _reference(pair, "model", "auto", probe, "def fib(n):")


def test_a_full_cache_queues_requests_and_is_never_overcommitted(pair):
    """A page pool for about two worst-case rows and four slots: the other requests wait, and the pages in
    use never exceed the pool; every request still gets generate()'s tokens."""
    tokenizer = pair[2]
    engine = _engine(pair, runner="paged", max_rows=4, cache_tokens=256)
    kv, budget = engine.batcher.target.kv, engine.batcher.budget
    most = {"pages": 0, "rows": 0}
    step = engine.batcher.step

    def watched_step():
        step()
        kv.check_invariants()
        most["pages"] = max(most["pages"], kv.num_pages - kv.num_free_pages)
        most["rows"] = max(most["rows"], len(engine.batcher.running))

    engine.batcher.step = watched_step
    requests = [_request(tokenizer, p, max_new=60, sampling=f, seed=i, eos=False)
                for i, (p, f) in enumerate(zip(PROMPTS, FILTERS))]
    assert budget.units(len(requests[0].prompt), 60) * 3 > budget.capacity  # three never fit together
    references = [_reference(pair, "model", "paged", r, p) for r, p in zip(requests, PROMPTS)]
    sinks = _run_to_end(engine, requests)
    assert [s.tokens for s in sinks] == references
    assert most["rows"] == 2 and most["pages"] <= kv.num_pages
    assert kv.num_free_pages == kv.num_pages and budget.used == 0


def test_cancel_frees_the_row_and_its_pages_at_once(pair):
    tokenizer = pair[2]
    engine = _engine(pair, runner="paged", max_rows=1)
    kv = engine.batcher.target.kv
    engine.start()
    try:
        with slow_target(pair[0], 0.005):
            running, queued, after = Collector(), Collector(), Collector()
            handle = engine.submit(_request(tokenizer, "def f(x):", max_new=200, eos=False), running)
            running.next()
            engine.submit(_request(tokenizer, "import os", max_new=30, eos=False), queued).cancel()
            assert queued.wait().reason == CANCELLED and queued.tokens == []  # never ran
            handle.cancel()
            assert running.wait().reason == CANCELLED and 0 < len(running.tokens) < 200
            assert wait_until(engine.idle)
            assert kv.num_free_pages == kv.num_pages and engine.batcher.budget.used == 0
            kv.check_invariants()
            engine.submit(_request(tokenizer, "import os", max_new=30, eos=False), after)  # the slot is reused
            assert after.wait().reason == "length" and len(after.tokens) == 30
    finally:
        engine.stop()
    assert engine.metrics.finished[CANCELLED] == 2


def test_a_failing_row_ends_alone_and_frees_its_slot(pair):
    """One row's logits turn NaN at its third step: it fails with the verifier's reason, the others finish
    with generate()'s tokens."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=4)
    target = engine.batcher.target
    forward, calls = target.forward, {"n": 0}

    def poisoned_forward(input_ids, num_tokens=None, tree_parents=None):
        logits = forward(input_ids, num_tokens, tree_parents)
        calls["n"] += 1
        if calls["n"] == 3:
            logits[1] = float("nan")  # slot 1
        return logits

    target.forward = poisoned_forward
    requests = [_request(tokenizer, p, max_new=25, sampling=f, seed=i, eos=False)
                for i, (p, f) in enumerate(zip(PROMPTS[:3], FILTERS[:3]))]
    bad = _request(tokenizer, "x", max_new=5, sampling=SamplingParams(float("nan")))  # fails at its prefill
    sinks = _run_to_end(engine, requests + [bad])
    assert sinks[1].reason == FAILED and "NaN" in sinks[1].message
    assert sinks[3].reason == FAILED and "temperature" in sinks[3].message
    for i in (0, 2):
        assert sinks[i].tokens == _reference(pair, "model", "auto", requests[i], PROMPTS[i])
    assert engine.batcher.budget.used == 0 and engine.batcher.free_slots == 4


def test_a_request_whose_row_cannot_hold_its_values_fails_alone_at_admission(pair):
    """A temperature above float32's largest and a seed beyond int64 cannot be written into the row's tensors:
    those requests fail as they join, the requests admitted in the same step finish with generate()'s tokens
    (the raise used to fail the whole step)."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=4)
    requests = [_request(tokenizer, p, max_new=20, sampling=f, seed=i, eos=False)
                for i, (p, f) in enumerate(zip(PROMPTS[:2], FILTERS[:2]))]
    hot = _request(tokenizer, "x", max_new=5, sampling=SamplingParams(1e39))
    huge_seed = _request(tokenizer, "y", max_new=5, sampling=SamplingParams(1.0), seed=2 ** 64)
    sinks = _run_to_end(engine, [requests[0], hot, requests[1], huge_seed])
    for sink in (sinks[1], sinks[3]):
        assert sink.reason == FAILED and sink.tokens == []
        assert "its sampling parameters could not be set" in sink.message and "overflow" in sink.message.lower()
    for i, sink in zip((0, 1), (sinks[0], sinks[2])):
        assert sink.reason == "length" and sink.tokens == _reference(pair, "model", "auto", requests[i], PROMPTS[i])
    assert engine.batcher.budget.used == 0 and engine.batcher.free_slots == 4
    assert engine.metrics.finished[FAILED] == 2


def test_shutdown_aborts_the_queued_at_once_and_the_running_after_the_grace(pair):
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=1)
    running, queued = Collector(), Collector()
    engine.start()
    try:
        with slow_target(pair[0], 0.005):
            engine.submit(_request(tokenizer, "def f(x):", max_new=230, eos=False), running)
            running.next()
            engine.submit(_request(tokenizer, "import os", max_new=5), queued)
            engine.begin_shutdown(grace_s=0.0)
            assert queued.wait().reason == ABORTED and "not started" in queued.message
            assert running.wait().reason == ABORTED and "shutting down" in running.message
            with pytest.raises(ShuttingDownError, match="shutting down"):
                engine.submit(_request(tokenizer, "a", max_new=2), Collector())
    finally:
        engine.stop()
    assert engine.batcher.budget.used == 0


def test_limits_refuse_with_the_numbers(pair):
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=1, max_queue=1)  # not started: nothing leaves the queue
    with pytest.raises(RequestTooLargeError, match=r"1003 tokens, past this server's context of 248 \(max_model_len: rows of 256 positions, 8 of them kept"):
        engine.submit(_request(tokenizer, "abc", max_new=1000), Collector())
    engine.submit(_request(tokenizer, "abc", max_new=4), Collector())  # takes the free slot's place
    engine.submit(_request(tokenizer, "abc", max_new=4), Collector())  # the one queue place
    with pytest.raises(QueueFullError) as full:
        engine.submit(_request(tokenizer, "abc", max_new=4), Collector())
    assert full.value.retry_after >= 1 and full.value.status == 429
    paged = _engine(pair, runner="paged", max_rows=2, cache_tokens=128)
    with pytest.raises(RequestTooLargeError, match=r"\(8 pages of 16\) but the cache holds 6 pages"):
        paged.submit(_request(tokenizer, "abc", max_new=110), Collector())
    rendered = engine.metrics.render(engine.gauges())
    assert 'specdec_requests_rejected_total{reason="too_large"} 1' in rendered
    assert 'specdec_requests_rejected_total{reason="queue_full"} 1' in rendered
    assert "specdec_queue_length 2" in rendered


def test_requests_taken_for_a_step_count_against_the_queue_until_they_run(pair, monkeypatch):
    """The rows a step is admitting are in neither the queue nor the running count until the step ends: the
    queue bound still holds for a burst then (it took max_queue + max_rows more: 4 of 10, not 2)."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=2, max_queue=2)
    entered, release = threading.Event(), threading.Event()
    admit = engine.batcher.admit

    def slow_admit(admissions):
        entered.set()
        release.wait(10)
        return admit(admissions)

    monkeypatch.setattr(engine.batcher, "admit", slow_admit)
    first = [Collector(), Collector()]
    for sink in first:
        engine.submit(_request(tokenizer, "abc", max_new=4), sink)
    engine.start()
    try:
        assert entered.wait(10)  # both taken from the queue, their prefill under way
        burst = []
        for _ in range(4):
            try:
                burst.append(engine.submit(_request(tokenizer, "abc", max_new=4), Collector()))
            except QueueFullError:
                pass
        assert len(burst) == 2
    finally:
        release.set()
        for sink in first:
            sink.wait()
        engine.stop()


def test_build_engine_refuses_what_it_cannot_serve(pair):
    target, draft, tokenizer = pair
    with pytest.raises(ValueError, match="heads drafter proposes trees"):
        build_engine(Models(target, "heads", tokenizer=tokenizer))
    with pytest.raises(ValueError, match="max_rows must be an int >= 1"):
        _engine(pair, max_rows=0)
    with pytest.raises(ValueError, match="cache_tokens sizes the paged runner's page pool"):
        _engine(pair, cache_tokens=1000)
    with pytest.raises(ValueError, match="kept for one step of drafts per slot"):
        _engine(pair, runner="paged", max_rows=8, cache_tokens=64)


def test_metrics_count_tokens_passes_and_acceptance(pair):
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=2)
    _run_to_end(engine, [_request(tokenizer, "def f(x):", max_new=20, eos=False) for _ in range(2)])
    metrics = engine.metrics
    assert metrics.generated_tokens == 40 and metrics.finished["length"] == 2
    steps = metrics.steps
    assert steps.steps >= 1 and steps.row_steps >= steps.steps  # two rows share the passes
    assert 1.0 <= metrics.tokens_per_target_pass() <= K + 1
    assert steps.reached[0] == steps.row_steps and all(a <= r for a, r in zip(steps.accepted, steps.reached))
    assert metrics.ttft.count == 2 and metrics.tpot.count == 2
    assert torch.isfinite(torch.tensor(metrics.tpot.sum))
