"""specdec serve's limits over HTTP, with a target slowed down so that requests stay in flight: 429 with
Retry-After when every row runs and the queue is full, a request larger than the page pool, clients that go
away (streaming and not) cancel their rows and give their pages back, and a graceful shutdown finishes the
requests in flight while refusing new ones."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from specdec_ext.serve.engine import DRAINING
from serve_utils import (MODEL_NAME, ServerThread, make_app, metrics, openai_client, serve_app, slow_target, tiny_pair,
                         wait_until)

K = 3
SLOW_PASS_S = 0.02  # per target forward: a 100-token request takes well over a second
LONG = dict(max_tokens=100, temperature=0, extra_body={"ignore_eos": True})


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    target, draft, tokenizer = tiny_pair()
    with slow_target(target, SLOW_PASS_S):
        yield target, draft, tokenizer


@pytest.fixture(scope="module")
def server(pair):
    # 2 rows, 1 queue place; a pool of 18 pages of 16 (2 kept for drafts): two 100-token rows fit, a
    # 300-position request fits a 512-position row but not the pool
    yield from serve_app(pair, runner="paged", max_rows=2, max_queue=1, k=K, max_seq_len=512, cache_tokens=288)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _idle_and_free(server) -> bool:
    m = metrics(server)
    return m[("specdec_running_rows", ())] == 0 and m[("specdec_cache_pages_in_use", ())] == 0


def _cancelled(server) -> float:
    return metrics(server).get(("specdec_requests_total", (("finish_reason", "cancelled"),)), 0)


def test_a_full_server_answers_429_with_retry_after(server, client):
    streams = []
    try:
        for _ in range(2):
            streams.append(client.completions.create(model=MODEL_NAME, prompt="def f(x):", stream=True, **LONG))
            next(iter(streams[-1]))  # its first token: it runs
        streams.append(client.completions.create(model=MODEL_NAME, prompt="def g(x):", stream=True, **LONG))
        assert metrics(server)[("specdec_queue_length", ())] == 1
        response = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "abc"})
        assert response.status_code == 429
        assert int(response.headers["Retry-After"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"  # OpenAI's shape
        assert "all 2 rows are running" in error["message"]
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL_NAME, prompt="abc")
    finally:
        for stream in streams:
            stream.close()
    assert wait_until(lambda: _idle_and_free(server))
    assert metrics(server)[("specdec_requests_rejected_total", (("reason", "queue_full"),))] == 2


def test_a_client_that_disconnects_mid_stream_cancels_its_row_and_frees_its_pages(server, client):
    before = _cancelled(server)
    stream = client.completions.create(model=MODEL_NAME, prompt="def f(x):", stream=True, **LONG)
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert metrics(server)[("specdec_cache_pages_in_use", ())] > 0
    stream.close()
    assert wait_until(lambda: _idle_and_free(server))
    assert _cancelled(server) == before + 1
    server.engine.batcher.target.kv.check_invariants()


def test_a_client_that_gives_up_on_a_whole_response_cancels_its_row(server):
    before = _cancelled(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.2,  # the row needs at least 50 passes: 1 s
                   json={"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True})
    assert wait_until(lambda: _idle_and_free(server))
    assert _cancelled(server) == before + 1


def test_a_request_larger_than_the_page_pool_is_refused_with_the_numbers(server):
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": MODEL_NAME, "prompt": "abc", "max_tokens": 290})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens"
    assert "needs 301 cache positions (19 pages of 16) but the cache holds 16 pages" in error["message"]


def test_shutdown_finishes_the_requests_in_flight_and_refuses_new_ones(pair):
    app, engine = make_app(*pair, max_rows=2, k=K, max_seq_len=256)
    server = ServerThread(app, engine, grace_s=30.0).start()
    client = openai_client(server)
    stream = client.completions.create(model=MODEL_NAME, prompt="def f(x):", stream=True, max_tokens=40,
                                       temperature=0, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    text = next(chunks).choices[0].text
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    assert wait_until(lambda: engine.state == DRAINING)
    try:
        refused = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "abc"}, timeout=5)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    except httpx.ConnectError:
        pass  # the listening socket is already closed
    rest = list(chunks)
    stopper.join(30)
    assert not stopper.is_alive()
    assert rest[-1].choices[0].finish_reason == "length"
    text += "".join(c.choices[0].text for c in rest)
    assert engine.metrics.finished["length"] == 1 and engine.metrics.generated_tokens == 40 and text
