"""`specdec serve`'s scheduling under load, as a load tester and an outside client see it: the draft length by
load, chunked prefill and the TPOT target each on and off while requests of mixed shapes (1-token to
near-context prompts, 1 to hundreds of new tokens, n > 1, stop strings, seeded samples, cancellations) arrive
staggered; the prefill chunk's edges; the queue's and the cache budget's bounds; /metrics under load; the
drain on SIGTERM; and the engine's edge cases (cancelled before / during prefill, a reused request id,
max_tokens=1 with n=4, a client that never reads its stream).

No timing assertions: the tests read the engine's events, its step log and /metrics counters.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional

import httpx
import pytest
import torch

from specdec_ext import plain_generate
from specdec_ext.models import Models
from specdec_ext.sampling import SamplingParams
from specdec_ext.serve.build import EngineOptions, build_engine
from specdec_ext.serve.engine import DRAINING
from specdec_ext.serve.request import (ABORTED, CANCELLED, GenerationRequest, QueueFullError, RequestTooLargeError,
                                       ShuttingDownError)
from specdec_ext.stops import StopCriteria
from serve_utils import (MODEL_NAME, Collector, ServerThread, free_port, make_app, metrics, openai_client, serve_app,
                         save_tiny_pair, slow_target, tiny_pair, wait_healthy, wait_until)

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

SEQ = 256  # positions per row
WAIT_S = 30.0  # the longest a test waits for an engine event it expects


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def _engine(pair, drafter="model", **options):
    target, draft, tokenizer = pair
    models = Models(target, drafter, draft=draft if drafter == "model" else None, tokenizer=tokenizer)
    options.setdefault("max_seq_len", SEQ)
    return build_engine(models, EngineOptions(**options))


def _ids(tokenizer, prompt) -> List[int]:
    return list(prompt) if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]


def _request(tokenizer, prompt, max_new, *, temperature=0.0, seed=0, seeded=False, stop=(), eos=False,
             **kw) -> GenerationRequest:
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return GenerationRequest(_ids(tokenizer, prompt), SamplingParams(temperature), seed,
                             StopCriteria(max_new, [0] if eos else [], list(stop), decode), seeded=seeded, **kw)


def _group(tokenizer, prompt, max_new, n, **kw) -> List[GenerationRequest]:
    requests = [_request(tokenizer, prompt, max_new, **{**kw, "seed": kw.get("seed", 0) + i}) for i in range(n)]
    for request in requests[1:]:
        request.shares_prompt_with = requests[0].request_id
    return requests


_PLAIN: Dict[tuple, List[int]] = {}


def _plain(pair, prompt_ids, max_new, stop=(), eos=False) -> List[int]:
    """Plain greedy decoding of the prompt alone (cached)."""
    key = (tuple(prompt_ids), max_new, tuple(stop), eos)
    if key not in _PLAIN:
        target, _, tokenizer = pair
        _PLAIN[key] = plain_generate([list(prompt_ids)], target, max_new_tokens=max_new, tokenizer=tokenizer,
                                     eos_token_id=[0] if eos else False, stop=list(stop) or None).token_ids[0]
    return _PLAIN[key]


def _take_event(sink: Collector, timeout_s: float) -> bool:
    """Consume ``sink``'s next event within ``timeout_s`` (its tokens and how it ended); False if none came."""
    try:
        event = sink.events.get(timeout=max(timeout_s, 0.0))
    except Exception:
        return False
    sink.tokens += event.tokens
    if event.finished:
        sink.reason, sink.message = event.finish_reason, event.message
    return True


def _wait(sink: Collector, timeout_s: float = WAIT_S) -> bool:
    """Whether ``sink``'s request ended within ``timeout_s`` (its events consumed)."""
    deadline = time.monotonic() + timeout_s
    while sink.reason is None:
        if deadline <= time.monotonic() or not _take_event(sink, deadline - time.monotonic()):
            return False
    return True


def _first_event(sink: Collector, timeout_s: float = WAIT_S) -> bool:
    """Wait for ``sink``'s first event (consumed)."""
    return _take_event(sink, timeout_s)


def _settled(engine) -> bool:
    batcher = engine.batcher
    return engine.idle() and batcher.free_slots == batcher.max_rows and batcher.budget.used == 0


# ------------------------------------------------------------------------------------------ a mixed load
TEXTS = ["def fib(n):\n    return", "import os\nimport sys\n", "x = [1, 2, 3]\nprint(x", "a", "class a:\n  def",
         "for i in range(10):\n    print(i)\n", "while True:\n  x", "y = {'a': 1}\n"]
LONG_TEXT = "for i in range(10):\n    print(i)\nx = [i * 2 for i in range(7)]\n" * 5


@pytest.mark.parametrize("k, chunk, slo", [(None, 16, None), (None, 0, None), (3, 24, None), (None, 32, 10_000.0)],
                         ids=["k-by-load+chunk16", "k-by-load+whole", "k3+chunk24", "k-by-load+chunk32+slo"])
def test_a_mixed_staggered_load_gives_every_greedy_request_its_solo_tokens(pair, k, chunk, slo):
    """18 requests through 6 slots, arriving in three waves while the others run: 1-token to near-context
    prompts, 1 to 150 new tokens, n = 3 greedy and n = 2 seeded groups, stop strings, an EOS, seeded samples,
    and three cancellations (in the queue, between steps, during a chunked prefill). Every greedy row equals
    plain greedy decoding alone, each seeded row equals itself alone on the same server, every row ends, and
    the slots and the cache budget are all free afterwards."""
    tokenizer = pair[2]
    options = dict(max_rows=6, max_queue=64, k=k, prefill_chunk=chunk, tpot_slo_ms=slo)
    engine = _engine(pair, **options)
    context = engine.batcher.budget.context_len
    near = _ids(tokenizer, LONG_TEXT * 2)[: context - 12]
    long_ids = _ids(tokenizer, LONG_TEXT)[:150]
    greedy = [  # (prompt ids, max_new, stop, eos)
        (_ids(tokenizer, TEXTS[0]), 150, (), False), (_ids(tokenizer, "a"), 1, (), False),
        (near, 12, (), False), (long_ids, 40, (), False), (_ids(tokenizer, TEXTS[1]), 60, ("\n",), False),
        (_ids(tokenizer, TEXTS[2]), 90, ("print",), False), (_ids(tokenizer, TEXTS[4]), 70, (), True),
        ([7], 33, (), False), (_ids(tokenizer, TEXTS[5]), 2, (), False), (_ids(tokenizer, TEXTS[6]), 120, (), False),
    ]
    seeded = [(_ids(tokenizer, TEXTS[7]), 50, 11), (long_ids[:90], 30, 12), (_ids(tokenizer, "q"), 80, 13)]
    waves: List[List[tuple]] = [[], [], []]
    for i, (prompt, max_new, stop, eos) in enumerate(greedy):
        waves[i % 3].append(("greedy", [_request(tokenizer, prompt, max_new, stop=stop, eos=eos)],
                             (prompt, max_new, stop, eos)))
    for i, (prompt, max_new, seed) in enumerate(seeded):
        waves[(i + 1) % 3].append(("seeded", [_request(tokenizer, prompt, max_new, temperature=1.0, seed=seed,
                                                       seeded=True)], None))
    waves[1].append(("greedy-n", _group(tokenizer, TEXTS[3] * 3, 25, 3), (_ids(tokenizer, TEXTS[3] * 3), 25, (), False)))
    waves[2].append(("seeded-n", _group(tokenizer, TEXTS[0], 20, 2, temperature=0.9, seed=40, seeded=True), None))
    cancel_queued = _request(tokenizer, TEXTS[1], 100)
    cancel_running = _request(tokenizer, TEXTS[2], 200)
    cancel_prefill = _request(tokenizer, near[:180], 20)
    if chunk:  # cancelled as its first chunk is fed: it ends during its prefill
        feed = engine.batcher._feed_chunk

        def feed_and_cancel(row, piece):
            logits = feed(row, piece)
            if row.request is cancel_prefill and row.prefilled == 0:
                engine.cancel(cancel_prefill.request_id)
            return logits

        engine.batcher._feed_chunk = feed_and_cancel
    entries = []  # (kind, requests, sinks, reference)

    def submit(kind, requests, reference):
        sinks = [Collector() for _ in requests]
        engine.submit_group(requests, sinks)
        entries.append((kind, requests, sinks, reference))
        return sinks

    engine.start()
    try:
        first = None
        for kind, requests, reference in waves[0]:
            sinks = submit(kind, requests, reference)
            first = first or sinks[0]
        running = submit("cancel-running", [cancel_running], None)[0]
        assert _first_event(running)
        engine.cancel(cancel_running.request_id)
        for kind, requests, reference in waves[1]:
            submit(kind, requests, reference)
        queued = submit("cancel-queued", [cancel_queued], None)[0]
        engine.cancel(cancel_queued.request_id)
        assert _first_event(first)
        for kind, requests, reference in waves[2]:
            submit(kind, requests, reference)
        prefilling = submit("cancel-prefill", [cancel_prefill], None)[0]
        ended = [all(_wait(sink) for sink in sinks) for _, _, sinks, _ in entries]
        assert all(ended), [(kind, [s.reason for s in sinks]) for kind, _, sinks, _ in entries]
        assert wait_until(lambda: _settled(engine), WAIT_S)
    finally:
        engine.stop()
    assert running.reason == CANCELLED and 0 < len(running.tokens) < 200
    assert queued.reason == CANCELLED and len(queued.tokens) < 100
    if chunk:
        assert prefilling.reason == CANCELLED and prefilling.tokens == []
    for kind, requests, sinks, reference in entries:
        if kind.startswith("greedy"):
            want = _plain(pair, *reference)
            for sink in sinks:
                assert sink.tokens == want, (kind, reference[1], reference[2])
                assert sink.reason in ("length", "stop", "eos")
    # each seeded row alone on a fresh server of the same options
    for kind, requests, sinks, _ in entries:
        if not kind.startswith("seeded"):
            continue
        for request, sink in zip(requests, sinks):
            alone_engine = _engine(pair, **options)
            alone = Collector()
            solo = _request(tokenizer, request.prompt, request.max_new_tokens, temperature=request.sampling.temperature,
                            seed=request.seed, seeded=True)
            alone_engine.submit(solo, alone)
            alone_engine.start()
            try:
                assert _wait(alone)
            finally:
                alone_engine.stop()
            assert sink.tokens == alone.tokens, (kind, request.seed)
    rendered = engine.metrics.render(engine.gauges())
    assert "specdec_running_rows 0" in rendered and "specdec_queue_length 0" in rendered


# ------------------------------------------------------------------------------------------ the first request
@pytest.mark.parametrize("options, body", [
    (dict(k=3, prefill_chunk=0), dict(max_tokens=1)),
    (dict(runner="paged", k=3), dict(max_tokens=1, n=2)),
    (dict(prefill_chunk=0), dict(max_tokens=1)),
    (dict(k=3, prefill_chunk=0), dict(max_tokens=0, echo=True, logprobs=1)),
], ids=["k3-whole-max_tokens=1", "paged-n2-max_tokens=1", "k-by-load-whole-max_tokens=1", "k3-whole-echo-max_tokens=0"])
def test_a_first_request_that_ends_at_its_prefill_leaves_the_server_serving(pair, options, body):
    """Was a defect, fixed: on a fresh whole-prompt-prefill server with a draft model (``-k N``, the paged runner, or
    ``--no-calibrate``), a first request that ends at its prefill (max_tokens 1, or 0 with echo) frees its
    slot in the drafter before the drafter ever made its runner (ModelDrafter.free_rows: 'NoneType' object
    has no attribute 'free_rows'): the step fails, the clean-up fails the same way, and the engine is broken
    for good: every later request is a 503 and /health says "broken". Expected: the server serves on."""
    for server in serve_app(pair, max_rows=2, max_seq_len=SEQ, **options):
        try:
            first = httpx.post(server.url + "/v1/completions", timeout=10,
                               json={"model": MODEL_NAME, "prompt": "abc", "temperature": 0, **body})
        except httpx.ReadTimeout:
            pytest.fail(f"the first request ({body}) never got its response; /health: "
                        f"{httpx.get(server.url + '/health', timeout=10).text}")
        assert first.status_code == 200, first.text
        second = httpx.post(server.url + "/v1/completions", timeout=30,
                            json={"model": MODEL_NAME, "prompt": "abc", "max_tokens": 5, "temperature": 0})
        assert second.status_code == 200, second.text
        assert second.json()["usage"]["completion_tokens"] == 5
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200, health.text


# ------------------------------------------------------------------------------------------ the TPOT target
def _slo_engine_after_one_request(pair, **options):
    """A started engine with a TPOT target no batch can meet (1 us per token), one request run to measure
    the time per token at width 1."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=4, tpot_slo_ms=1e-3, k=3, **options)
    engine.start()
    sink = Collector()
    engine.submit(_request(tokenizer, "def f(x):", 12), sink)
    assert _wait(sink) and sink.reason == "length"
    assert wait_until(lambda: _settled(engine), WAIT_S)
    return engine


def test_n_choices_join_an_empty_batch_under_a_tpot_target_it_cannot_meet(pair):
    """Was a defect, fixed: "one row always runs" under --tpot-slo-ms, but a request's n choices are admitted together and
    ContinuousBatcher.open_slots opens one slot of an empty batch when the width 2 it would make is measured
    above the target: an n=2 request waits in the queue for ever (nothing runs, so nothing is measured again).
    Expected: the choices of a request join an empty batch (or the request is refused), never a hang."""
    tokenizer = pair[2]
    engine = _slo_engine_after_one_request(pair)
    try:
        group = _group(tokenizer, "abc", 5, 2)
        sinks = [Collector() for _ in group]
        engine.submit_group(group, sinks)
        ended = [_wait(sink, 15.0) for sink in sinks]
        queued = engine.gauges()["queue_length"][1]
        assert all(ended), f"the n=2 request never ran: queue_length={queued}, open_slots={engine.batcher.open_slots}"
        assert [sink.reason for sink in sinks] == ["length", "length"]
        assert sinks[0].tokens == sinks[1].tokens == _plain(pair, group[0].prompt, 5)
    finally:
        engine.stop()


def test_the_queue_bound_holds_while_a_tpot_target_keeps_free_slots_closed(pair):
    """Was a defect, fixed: with max_queue=0 and a TPOT target that keeps one row running, submit counts the free slots
    the target keeps closed as places (a request there would join at the next step, but it does not): three
    requests sit in the queue (queue_length 3 > max_queue 0) for as long as the row runs. Expected: the
    requests that wait never exceed max_queue; the others are refused with 429 (QueueFullError)."""
    target, _, tokenizer = pair
    engine = _slo_engine_after_one_request(pair, max_queue=0)
    try:
        with slow_target(target, 0.01):
            long = Collector()
            engine.submit(_request(tokenizer, "def f(x):", 200), long)
            assert _first_event(long) and _first_event(long)  # running, and measured at width 1
            taken, refused = [], 0
            for _ in range(4):
                try:
                    sink = Collector()
                    engine.submit(_request(tokenizer, "abc", 3), sink)
                    taken.append(sink)
                except QueueFullError:
                    refused += 1
            assert _first_event(long) and _first_event(long)  # two more steps: each could have admitted them
            waiting = engine.gauges()["queue_length"][1]
            running = engine.gauges()["running_rows"][1]
            engine.cancel(engine.batcher.running[0].request.request_id)
        assert waiting <= engine.max_queue, (f"{waiting} requests wait with max_queue=0 ({running} running, "
                                             f"{len(taken)} taken, {refused} refused)")
        for sink in taken:
            assert _wait(sink)
    finally:
        engine.stop()


# ------------------------------------------------------------------------------------------ chunked prefill
@pytest.mark.parametrize("chunk, prompt_len", [(1, 120), (40, 40), (5000, 200)],
                         ids=["chunk1", "chunk-equals-prompt", "chunk-past-the-context"])
def test_a_prompt_joins_beside_a_decoding_row_at_the_chunk_s_edges(pair, chunk, prompt_len):
    """Chunk size 1 (each step still feeds MIN_PREFILL_CHUNK), a prompt exactly of the chunk's size (less the
    running row's verify tokens: two steps) and a chunk larger than a row (one step): the prompt is fed whole
    across the step log, no step feeds more than the chunk or the floor allows, the decoding row emits in
    every step that fed a chunk, and both rows get plain greedy decoding's tokens."""
    from specdec_ext.plan import MIN_PREFILL_CHUNK

    tokenizer = pair[2]
    prompt = _ids(tokenizer, LONG_TEXT)[:prompt_len]
    assert len(prompt) == prompt_len
    engine = _engine(pair, max_rows=2, k=3, prefill_chunk=chunk)
    running, joining = Collector(), Collector()
    engine.submit(_request(tokenizer, TEXTS[1], 60), running)
    engine.start()
    try:
        assert _first_event(running)
        engine.submit(_request(tokenizer, prompt, 20), joining)
        assert _wait(joining) and _wait(running)
    finally:
        engine.stop()
    chunks = [record for record in engine.batcher.step_log if 1 in record.prefilled]
    assert sum(record.prefilled[1] for record in chunks) == prompt_len
    assert all(record.prefilled[1] <= max(chunk, MIN_PREFILL_CHUNK) for record in chunks)
    if chunk == 1:
        assert len(chunks) == -(-prompt_len // MIN_PREFILL_CHUNK)
    if chunk >= SEQ:
        assert len(chunks) == 1
    assert all(record.emitted.get(0, 0) >= 1 for record in chunks if not running.reason or record.width)
    assert joining.tokens == _plain(pair, prompt, 20)
    assert running.tokens == _plain(pair, _ids(tokenizer, TEXTS[1]), 60)


def test_a_group_leader_cancelled_during_its_chunked_prefill_hands_the_prompt_to_its_choices(pair):
    """n = 3 greedy choices of a 150-token prompt joining beside a decoding row in chunks; the first choice
    (whose prefill serves the group) is cancelled as its first chunk is fed: the other two prefill the prompt
    themselves and return plain greedy decoding's tokens; every slot and the budget are free afterwards."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=4, prefill_chunk=16, k=3)
    prompt = _ids(tokenizer, LONG_TEXT)[:150]
    group = _group(tokenizer, prompt, 20, 3)
    feed = engine.batcher._feed_chunk

    def feed_and_cancel(row, piece):
        logits = feed(row, piece)
        if row.request is group[0] and row.prefilled == 0:
            engine.cancel(group[0].request_id)
        return logits

    engine.batcher._feed_chunk = feed_and_cancel
    keeper = Collector()
    engine.submit(_request(tokenizer, "def f(x):", 100), keeper)
    engine.start()
    try:
        assert _first_event(keeper)
        sinks = [Collector() for _ in group]
        engine.submit_group(group, sinks)
        assert all(_wait(sink) for sink in sinks) and _wait(keeper)
        assert wait_until(lambda: _settled(engine), WAIT_S)
    finally:
        engine.stop()
    assert [sink.reason for sink in sinks] == [CANCELLED, "length", "length"] and sinks[0].tokens == []
    assert sinks[1].tokens == sinks[2].tokens == _plain(pair, prompt, 20)
    assert keeper.tokens == _plain(pair, _ids(tokenizer, "def f(x):"), 100)


# ------------------------------------------------------------------------------------------ drain (SIGTERM)
@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """A tiny pair saved as model directories (the tokenizer beside the target), rows of 2048 positions."""
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), 2048)


def _sse_lines(url: str, body: dict, out: list) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            out.append(response.status_code)
            for line in response.iter_lines():
                if line:
                    out.append(line)
    except httpx.HTTPError as error:  # (recorded: the test says what it expected)
        out.append(error)


def test_sigterm_lets_the_request_in_flight_finish_aborts_the_queued_one_and_exits_0(saved_pair):
    """`specdec serve --max-rows 1 --shutdown-grace 60` with one long request decoding and one queued behind
    it: SIGTERM aborts the queued one at once with a message (its stream ends with an error event and
    [DONE]), the one in flight finishes all its tokens ("length", the usage's count), a new request is
    refused (503, or no listener any more), and the process exits 0."""
    target, draft = saved_pair
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "specdec_ext", "serve", "--target", str(target), "--draft", str(draft),
               "--port", str(port), "--model-name", MODEL_NAME, "--max-rows", "1", "--max-queue", "4",
               "--threads", "1", "--shutdown-grace", "60", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(process, url)
        new_tokens = 1200
        running: list = []
        queued: list = []
        body = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": new_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        first = threading.Thread(target=_sse_lines, args=(url, body, running))
        first.start()
        assert wait_until(lambda: len(running) >= 3, 60), running  # (status, then chunks: it decodes)
        second = threading.Thread(target=_sse_lines, args=(url, {**body, "max_tokens": 5}, queued))
        second.start()
        assert wait_until(lambda: metrics_of(url).get(("specdec_queue_length", ()), 0) == 1, 30)
        assert running[-1] != "data: [DONE]"  # still in flight
        process.send_signal(signal.SIGTERM)
        second.join(60)
        try:
            refused = httpx.post(url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "abc"}, timeout=10)
            assert refused.status_code == 503
        except httpx.TransportError:
            pass  # the listening socket is closed already
        first.join(120)
        assert process.wait(90) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert queued[0] == 200 and queued[-1] == "data: [DONE]", queued
    error = json.loads(queued[-2][len("data: "):])["error"]
    assert error["code"] == "aborted" and "shutting down" in error["message"]
    assert running[0] == 200 and running[-1] == "data: [DONE]", running[-3:]
    chunks = [json.loads(line[len("data: "):]) for line in running[1:-1]]
    assert all("error" not in chunk for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == new_tokens
    assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == ["length"]


def metrics_of(url: str) -> dict:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.TransportError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            name, _, label_text = head.partition("{")
            labels = tuple(sorted(tuple(part.split("=", 1)) for part in label_text.rstrip("}").split(",") if part))
            out[(name, tuple((k, v.strip('"')) for k, v in labels))] = float(value)
    return out


# ------------------------------------------------------------------------------------------ /metrics under load
def _client_call(url: str, body: dict, results: list, index: int) -> None:
    if body.get("stream"):
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream_options": {"include_usage": True}},
                          timeout=120) as response:
            lines = [line for line in response.iter_lines() if line]
        chunks = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: {")]
        results[index] = (response.status_code, chunks[-1]["usage"]["completion_tokens"],
                          sum(1 for chunk in chunks for c in chunk["choices"] if c["finish_reason"]))
    else:
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
        reply = response.json()
        results[index] = (response.status_code, reply["usage"]["completion_tokens"], len(reply["choices"]))


def test_metrics_under_concurrent_load_are_monotone_and_add_up(pair):
    """14 concurrent clients (streamed or not, n = 1 or 2, 1 to 90 tokens, greedy and sampled) on a k-by-load,
    chunked-prefill server of 4 rows while /metrics is scraped all along: every counter, histogram bucket, sum
    and count only grows; running rows never pass max_rows; afterwards the decode steps by draft length add up
    to the target passes (and to the step log's decode steps), the speculation-off steps are those of k=0,
    the TTFT histogram counts the rows that got a token, the TPOT one those that got two or more, the rows
    ended equal the choices served, the generated tokens the usage's, and the gauges are back at 0."""
    shapes = [("def f(x):", 5), ("import os\n", 40), ("abc" * 30, 90), ("q", 1), ("x = [", 60), ("class A:", 2)]
    bodies = []
    for i in range(14):
        prompt, max_tokens = shapes[i % len(shapes)]
        bodies.append({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0 if i % 2 else 0.8, "n": 2 if i % 4 == 0 else 1, "stream": i % 3 == 0})
    for server in serve_app(pair, max_rows=4, max_queue=32, max_seq_len=SEQ, prefill_chunk=16):
        # (a first request warms the drafter up: see test_a_first_request_that_ends_at_its_prefill_...)
        assert httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "abc", "max_tokens": 3, "temperature": 0}).status_code == 200
        before = metrics(server)
        samples, done = [before], threading.Event()

        def scrape():
            while not done.is_set():
                samples.append(metrics(server))
                time.sleep(0.005)

        scraper = threading.Thread(target=scrape)
        scraper.start()
        results: list = [None] * len(bodies)
        clients = [threading.Thread(target=_client_call, args=(server.url, body, results, i))
                   for i, body in enumerate(bodies)]
        try:
            for client in clients:
                client.start()
            for client in clients:
                client.join(120)
            assert wait_until(lambda: _settled(server.engine), WAIT_S)
        finally:
            done.set()
            scraper.join(30)
        after = metrics(server)
        samples.append(after)
        engine = server.engine
    assert all(result is not None and result[0] == 200 for result in results), results
    grows = [key for key in after if key[0].endswith(("_total", "_count", "_sum", "_bucket"))]
    for earlier, later in zip(samples, samples[1:]):
        for key in grows:
            assert later.get(key, 0) >= earlier.get(key, 0), key
    assert max(sample[("specdec_running_rows", ())] for sample in samples) <= 4

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    def family(name, sample):
        return sum(v for (n, _), v in sample.items() if n == name)

    by_length = family("specdec_draft_length_steps_total", after) - family("specdec_draft_length_steps_total", before)
    assert by_length == delta("specdec_target_passes_total") > 0
    assert sum(1 for record in engine.batcher.step_log if record.width) == family("specdec_draft_length_steps_total",
                                                                                 after)
    off = sum(v for (n, labels), v in after.items() if n == "specdec_draft_length_steps_total" and ("k", "0") in labels)
    assert after[("specdec_speculation_off_steps_total", ())] == off
    rows = sum(body["n"] for body in bodies)
    assert family("specdec_requests_total", after) - family("specdec_requests_total", before) == rows
    tokens = sum(result[1] for result in results)
    assert delta("specdec_generated_tokens_total") == tokens
    one_token = sum(body["n"] for body in bodies if body["max_tokens"] == 1)
    assert delta("specdec_time_to_first_token_seconds_count") == rows
    assert delta("specdec_time_per_output_token_seconds_count") == rows - one_token
    for gauge in ("specdec_running_rows", "specdec_queue_length"):
        assert after[(gauge, ())] == 0
    assert after[("specdec_cache_budget_in_use", (("unit", "rows"),))] == 0


# ------------------------------------------------------------------------------------------ the queue's bounds
def test_the_queue_bound_counts_every_choice_and_free_slots_and_never_more(pair):
    """An engine not started (nothing leaves the queue), 4 rows and 2 queue places: exactly 6 rows' worth of
    requests are taken (an n=3 and an n=2 request and one more), the next one (n=1) is a 429 and so is an
    n=2 that would need one place more than is left; n=5 (more choices than rows) is refused as too large.
    Once started, no step runs more than 4 rows, the n=3 request's choices join together, and all end."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=4, max_queue=2, k=3)
    most = {"rows": 0}
    step = engine.batcher.step

    def watched_step():
        step()
        most["rows"] = max(most["rows"], len(engine.batcher.running))

    engine.batcher.step = watched_step
    sinks = []

    def submit(n, max_new=20):
        group = _group(tokenizer, TEXTS[0], max_new, n)
        group_sinks = [Collector() for _ in group]
        engine.submit_group(group, group_sinks)
        sinks.extend(group_sinks)

    submit(3)
    submit(2)
    with pytest.raises(QueueFullError):
        submit(2)
    submit(1)
    with pytest.raises(QueueFullError):
        submit(1)
    with pytest.raises(RequestTooLargeError, match="n = 5 choices need 5 rows"):
        submit(5)
    assert engine.gauges()["queue_length"][1] == 6
    engine.start()
    try:
        assert all(_wait(sink) for sink in sinks)
        assert wait_until(lambda: _settled(engine), WAIT_S)
    finally:
        engine.stop()
    assert most["rows"] <= 4
    want = _plain(pair, _ids(tokenizer, TEXTS[0]), 20)
    assert all(sink.tokens == want for sink in sinks)
    assert engine.metrics.rejected["queue_full"] == 2 and engine.metrics.rejected["too_large"] == 1


def test_long_prompts_that_exhaust_the_page_pool_wait_and_are_never_overcommitted(pair):
    """The paged runner with a pool for about two long rows, 4 slots: long prompts (150 tokens, 60 new), n=2
    groups sharing their prompt pages and short requests arrive together; the pages in use never pass the
    pool, the budget never passes its capacity, each request waits its turn and returns plain greedy
    decoding's tokens, and every page comes back."""
    tokenizer = pair[2]
    engine = _engine(pair, runner="paged", max_rows=4, cache_tokens=640, k=3)
    kv, budget = engine.batcher.target.kv, engine.batcher.budget
    most = {"pages": 0, "units": 0, "rows": 0}
    step = engine.batcher.step

    def watched_step():
        step()
        kv.check_invariants()
        most["pages"] = max(most["pages"], kv.num_pages - kv.num_free_pages)
        most["units"] = max(most["units"], budget.used)
        most["rows"] = max(most["rows"], len(engine.batcher.running))

    engine.batcher.step = watched_step
    long_prompt = _ids(tokenizer, LONG_TEXT)[:150]
    assert budget.units(150, 60) * 3 > budget.capacity  # three long rows never fit together
    work = [(_group(tokenizer, long_prompt, 60, 2), long_prompt, 60), ([_request(tokenizer, long_prompt[:140], 60)],
            long_prompt[:140], 60), ([_request(tokenizer, "abc", 30)], _ids(tokenizer, "abc"), 30),
            (_group(tokenizer, long_prompt[:120], 40, 3), long_prompt[:120], 40),
            ([_request(tokenizer, long_prompt[:100], 60)], long_prompt[:100], 60)]
    entries = []
    for requests, prompt, max_new in work:
        group_sinks = [Collector() for _ in requests]
        engine.submit_group(requests, group_sinks)
        entries.append((group_sinks, prompt, max_new))
    engine.start()
    try:
        assert all(_wait(sink) for sinks, _, _ in entries for sink in sinks)
        assert wait_until(lambda: _settled(engine), WAIT_S)
    finally:
        engine.stop()
    for sinks, prompt, max_new in entries:
        for sink in sinks:
            assert sink.tokens == _plain(pair, prompt, max_new)
    assert most["pages"] <= kv.num_pages and most["units"] <= budget.capacity and most["rows"] >= 2
    assert kv.num_free_pages == kv.num_pages and budget.used == 0


# ------------------------------------------------------------------------------------------ engine edge cases
def test_max_tokens_1_with_n_4_on_a_warm_server_gives_four_one_token_choices(pair):
    """n = 4 greedy choices of one token each (every row ends at its join, before any decode step): four
    choices with the same token, the usage counting four, and the rows free again (a warm server: see the
    first-request defect above)."""
    for server in serve_app(pair, max_rows=4, max_seq_len=SEQ, runner="paged", k=3):
        url = server.url + "/v1/completions"
        assert httpx.post(url, timeout=30, json={"model": MODEL_NAME, "prompt": "abc", "max_tokens": 3,
                                                 "temperature": 0}).status_code == 200
        for _ in range(3):  # again and again: nothing leaks
            reply = httpx.post(url, timeout=30, json={"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 1,
                                                      "n": 4, "temperature": 0})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            assert len({c["text"] for c in body["choices"]}) == 1 and len(body["choices"]) == 4
            assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 4
            assert body["usage"]["completion_tokens"] == 4
        assert wait_until(lambda: _settled(server.engine), WAIT_S)
        assert server.engine.batcher.target.kv.num_free_pages == server.engine.batcher.target.kv.num_pages


def test_a_reused_request_id_runs_again_and_a_late_cancel_of_the_first_does_not_touch_it(pair):
    """The same request id submitted again after its first run ended (an engine caller's choice): a cancel
    that arrives for the finished run is dropped, the second run returns the same greedy tokens; two queued
    requests sharing an id: a cancel takes one of them out, the other runs."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=2, k=3)
    engine.start()
    try:
        first, again = Collector(), Collector()
        request = _request(tokenizer, TEXTS[0], 20)
        engine.submit(request, first)
        assert _wait(first) and first.reason == "length"
        engine.cancel(request.request_id)  # late: the run is over
        assert wait_until(lambda: not engine._cancelled, WAIT_S)
        twin = _request(tokenizer, TEXTS[0], 20, request_id=request.request_id)
        engine.submit(twin, again)
        assert _wait(again) and again.reason == "length" and again.tokens == first.tokens
    finally:
        engine.stop()
    stopped = _engine(pair, max_rows=1, k=3)  # not started: both stay queued
    a, b = Collector(), Collector()
    shared = _request(tokenizer, "abc", 5)
    stopped.submit(shared, a)
    stopped.submit(_request(tokenizer, "abc", 5, request_id=shared.request_id), b)
    stopped.cancel(shared.request_id)
    assert _wait(a, 5) and a.reason == CANCELLED
    stopped.start()
    try:
        assert _wait(b) and b.reason == "length" and b.tokens == _plain(pair, _ids(tokenizer, "abc"), 5)
    finally:
        stopped.stop()


def test_a_client_that_never_reads_its_stream_holds_nobody_up(pair):
    """A raw client sends a streamed request for 200 tokens and never reads a byte while three others run:
    their texts equal their solo texts, the unread row still decodes to its end and leaves (the engine's
    events are queued for it, never blocking the step), the server goes idle with the client still
    connected, and serves on after it leaves."""
    for server in serve_app(pair, max_rows=4, max_seq_len=SEQ, k=3):
        url = server.url + "/v1/completions"
        solo = lambda prompt: httpx.post(url, timeout=60, json={"model": MODEL_NAME, "prompt": prompt,
                                                                 "max_tokens": 40, "temperature": 0}).json()
        prompts = ["def f(x):", "import os\n", "x = ["]
        alone = [solo(p)["choices"][0]["text"] for p in prompts]
        ended = lambda: sum(v for (name, _), v in metrics(server).items() if name == "specdec_requests_total")
        before = ended()
        body = json.dumps({"model": MODEL_NAME, "prompt": "class A:", "max_tokens": 200, "stream": True,
                           "temperature": 0, "ignore_eos": True}).encode()
        silent = socket.create_connection(("127.0.0.1", server.port))
        try:
            silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert wait_until(lambda: metrics(server)[("specdec_running_rows", ())] >= 1, WAIT_S)
            results: list = [None] * 3
            clients = [threading.Thread(target=lambda i=i: results.__setitem__(i, solo(prompts[i])))
                       for i in range(3)]
            for client in clients:
                client.start()
            for client in clients:
                client.join(60)
            assert [r["choices"][0]["text"] for r in results] == alone
            assert wait_until(lambda: ended() == before + 4 and _settled(server.engine), WAIT_S), metrics(server)
        finally:
            silent.close()
        assert solo("abc")["usage"]["completion_tokens"] == 40


def test_a_drain_that_begins_during_a_chunked_prefill_finishes_that_prompt_and_aborts_the_queue(pair):
    """begin_shutdown (what SIGTERM calls) with a long grace lands as a joining prompt's first chunk is fed
    beside a decoding row: that row (it holds a slot: in flight) finishes its prefill and its tokens, the
    decoding row finishes, the queued request is aborted at once with a message, a new request is refused,
    and the engine ends with every slot free."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=2, prefill_chunk=16, k=3)
    prompt = _ids(tokenizer, LONG_TEXT)[:200]
    joining_request = _request(tokenizer, prompt, 30)
    feed = engine.batcher._feed_chunk
    queued = Collector()

    def feed_and_drain(row, piece):
        logits = feed(row, piece)
        if row.request is joining_request and row.prefilled == 0:
            engine.submit(_request(tokenizer, "abc", 5), queued)  # both rows held: it waits
            engine.begin_shutdown(grace_s=60.0)
        return logits

    engine.batcher._feed_chunk = feed_and_drain
    keeper, joining = Collector(), Collector()
    engine.submit(_request(tokenizer, "def f(x):", 120), keeper)
    engine.start()
    try:
        assert _first_event(keeper)
        engine.submit(joining_request, joining)
        assert _wait(queued) and queued.reason == ABORTED and "not started" in queued.message
        assert engine.state == DRAINING
        with pytest.raises(ShuttingDownError):
            engine.submit(_request(tokenizer, "abc", 5), Collector())
        assert _wait(joining) and _wait(keeper)
    finally:
        engine.stop()
    assert joining.reason == "length" and joining.tokens == _plain(pair, prompt, 30)
    assert keeper.reason == "length" and keeper.tokens == _plain(pair, _ids(tokenizer, "def f(x):"), 120)
    assert engine.batcher.free_slots == 2 and engine.batcher.budget.used == 0
