"""The n choices of one request share its prompt (issue 28): PagedKVCache.fork shares the full prompt
pages copy-on-write, every runner's fork_rows continues exactly as a fresh prefill would, and the serving
engine admits a request's choices together, prefills the prompt once and holds its pages once, while each
choice returns the tokens it returns as a request of its own (same seed)."""
from __future__ import annotations

from typing import List, Optional

import pytest
import torch

from specdec_ext.models import Models
from specdec_ext.runners import make_runner
from specdec_ext.runners.kv_cache import PagedKVCache, PoolFullError
from specdec_ext.sampling import SamplingParams
from specdec_ext.serve.app import choice_seed
from specdec_ext.serve.build import EngineOptions, build_engine
from specdec_ext.serve.request import CANCELLED, GenerationRequest, RequestTooLargeError
from specdec_ext.stops import StopCriteria
from serve_utils import Collector, tiny_pair
from test_generate_utils import tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

PAGE = 4
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 2 full pages of 4 and a partial one


def _cache(num_pages=12, rows=4) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=2, num_pages=num_pages, page_size=PAGE,
                        max_batch=rows, max_pages_per_row=6)


def _fill(kv: PagedKVCache, row: int, length: int, value: float) -> None:
    kv.append(row, torch.full((2, length, 1, 2), value), torch.full((2, length, 1, 2), -value))


# ---------------------------------------------------------------------------------------------- the pool
def test_fork_shares_the_full_pages_and_copies_the_partial_one():
    kv = _cache()
    _fill(kv, 0, 10, 1.0)
    kv.fork(0, [1, 2])
    kv.check_invariants()
    assert kv.pages(1)[:2] == kv.pages(0)[:2] == kv.pages(2)[:2]  # the two full pages, shared
    assert len({kv.pages(r)[2] for r in range(3)}) == 3  # the partial page: one copy each
    assert kv.num_shared_pages == 2 and kv.num_free_pages == 12 - 5  # 3 pages for the source, 1 + 1 copies
    for row in (1, 2):
        key, value = kv.read(row)
        assert key.shape == (2, 10, 1, 2) and bool((key == 1.0).all()) and bool((value == -1.0).all())
    _fill(kv, 1, 2, 5.0)  # positions 10, 11: row 1's own partial page
    assert bool((kv.read(0)[0] == 1.0).all()) and bool((kv.read(2)[0] == 1.0).all())
    assert kv.read(1)[0][:, 10:].eq(5.0).all()


def test_the_last_owner_frees_a_shared_page_and_the_others_keep_it():
    kv = _cache()
    _fill(kv, 0, 10, 2.0)
    kv.fork(0, [1])
    kv.free(0)  # the source leaves first
    kv.check_invariants()
    assert kv.num_free_pages == 12 - 3 and kv.num_shared_pages == 0
    assert bool((kv.read(1)[0] == 2.0).all())
    kv.free(1)
    kv.check_invariants()
    assert kv.num_free_pages == 12


def test_a_row_that_rolls_back_into_a_shared_page_copies_it_first():
    kv = _cache()
    _fill(kv, 0, 8, 3.0)
    kv.fork(0, [1])  # both hold pages 0 and 1 of row 0; 8 = 2 full pages, nothing partial
    assert kv.num_shared_pages == 2
    kv.rollback(1, 6)  # row 1 would write position 6 next: logical page 1 becomes its own
    kv.check_invariants()
    assert kv.pages(1)[0] == kv.pages(0)[0] and kv.pages(1)[1] != kv.pages(0)[1]
    _fill(kv, 1, 2, 9.0)
    assert bool((kv.read(0)[0] == 3.0).all())  # the source's page 1 is untouched
    assert kv.read(1)[0][:, 6:].eq(9.0).all() and kv.read(1)[0][:, :6].eq(3.0).all()


def test_fork_into_a_full_pool_changes_nothing():
    kv = _cache(num_pages=4)
    _fill(kv, 0, 10, 1.0)  # 3 pages; one free
    with pytest.raises(PoolFullError, match="forking row 0 into 2 row"):
        kv.fork(0, [1, 2])  # two partial copies, one free page
    kv.check_invariants()
    assert kv.num_free_pages == 1 and kv.pages(1) == [] and kv.length(1) == 0
    with pytest.raises(ValueError, match="must be empty"):
        kv.fork(0, [0])


def test_the_invariants_catch_a_shared_page_that_a_row_could_write():
    """The mutation this design guards against: the partial page shared instead of copied."""
    kv = _cache()
    _fill(kv, 0, 10, 1.0)
    kv.fork(0, [1])
    own = kv.pages(1)[2]
    kv._pages[1][2] = kv._pages[0][2]  # share the partial page, as a fork without the copy would
    kv._tables_host[1, 2] = kv._pages[0][2]
    kv._owners[kv._pages[0][2]] += 1
    kv._owners[own] -= 1
    kv._free.append(own)
    with pytest.raises(AssertionError, match="could write shared page"):
        kv.check_invariants()


# ---------------------------------------------------------------------------------------------- runners
@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", hidden=48, layers=2, logit_scale=4.0)


@pytest.mark.parametrize("kind", ["lean", "paged", "recompute"])
def test_forked_rows_continue_as_a_fresh_prefill_would(model, kind):
    """Row 0 is prefilled, rows 1 and 2 fork it; then the three take different tokens (each writes its own
    next page) and two steps of logits equal three fresh prefills stepped alike."""
    runner = make_runner(kind, model, max_batch_size=4, max_seq_len=64)
    fresh = make_runner(kind, model, max_batch_size=4, max_seq_len=64)
    expected = fresh.start([PROMPT] * 3)
    torch.testing.assert_close(runner.start_rows([0], [PROMPT]), expected[:1], rtol=1e-5, atol=1e-5)
    runner.fork_rows(0, [1, 2])
    assert runner.batch_size == 3 and runner.lengths.tolist() == [10, 10, 10]
    if kind == "paged":
        runner.kv.check_invariants()
        assert runner.kv.num_shared_pages == 10 // runner.page_size
    for tokens in ([[1, 2], [3, 4], [5, 6]], [[7], [8], [9]]):
        ids = torch.tensor(tokens)
        torch.testing.assert_close(runner.forward(ids), fresh.forward(ids), rtol=1e-4, atol=1e-4)
        runner.commit(torch.tensor([ids.shape[1]] * 3))
        fresh.commit(torch.tensor([ids.shape[1]] * 3))
    runner.free_rows([0])  # the source leaves; the forks keep the prompt
    ids = torch.tensor([[0], [1], [2]])
    kept = runner.forward(ids)
    torch.testing.assert_close(kept[1:], fresh.forward(ids)[1:], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="source row 0 is not in use"):
        runner.fork_rows(0, [3])
    with pytest.raises(ValueError, match="row 1 is in use"):
        runner.fork_rows(2, [1])


# ---------------------------------------------------------------------------------------------- serving
@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


def _engine(pair, **options):
    target, draft, tokenizer = pair
    return build_engine(Models(target, "model", draft=draft, tokenizer=tokenizer),
                        EngineOptions(k=3, max_seq_len=256, **options))


def _choices(tokenizer, prompt: str, n: int, *, seed=11, max_new=24) -> List[GenerationRequest]:
    """n choices as the server makes them: each its own Philox stream, the others sharing the first's prompt."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    ids = tokenizer(prompt)["input_ids"]
    requests = [GenerationRequest(list(ids), SamplingParams(1.0), choice_seed(seed, c),
                                  StopCriteria(max_new, [], [], decode)) for c in range(n)]
    for request in requests[1:]:
        request.shares_prompt_with = requests[0].request_id
    return requests


def _alone(engine, request: GenerationRequest) -> List[int]:
    """The request's tokens as a request of its own (a copy that shares nothing)."""
    single = GenerationRequest(request.prompt, request.sampling, request.seed, request.stop)
    sink = Collector()
    engine.submit(single, sink)
    return sink.wait().tokens


LONG_PROMPT = "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"


@pytest.mark.parametrize("runner, chunk", [("paged", None), ("lean", None), ("lean", 16)])
def test_n_choices_prefill_once_and_return_each_ones_own_tokens(pair, runner, chunk):
    """The prompt is prefilled once (start_rows counted), the choices' tokens are those of separate
    requests with the same seeds, and with the paged runner the prompt's full pages are held once."""
    tokenizer = pair[2]
    options = dict(runner=runner, max_rows=4)
    if chunk is not None:
        options["prefill_chunk"] = chunk
    engine = _engine(pair, **options)
    batcher, target = engine.batcher, engine.batcher.target
    prefilled: List[int] = []
    start_rows = target.start_rows
    target.start_rows = lambda rows, prompts: prefilled.append(len(rows)) or start_rows(rows, prompts)
    seen = {"shared": 0, "pages": 0}
    step = batcher.step

    def watched_step():
        step()
        if runner == "paged":
            target.kv.check_invariants()
            seen["shared"] = max(seen["shared"], target.kv.num_shared_pages)
            seen["pages"] = max(seen["pages"], batcher.budget.pages_in_use)

    batcher.step = watched_step
    requests = _choices(tokenizer, LONG_PROMPT, 3)
    sinks = [Collector() for _ in requests]
    engine.submit_group(requests, sinks)
    engine.start()
    try:
        together = [sink.wait().tokens for sink in sinks]
        assert prefilled == [1]  # one prefill (of its first chunk, under chunked prefill) for three choices
        alone = [_alone(engine, request) for request in requests]
    finally:
        engine.stop()
    assert together == alone and len({tuple(t) for t in together}) == 3
    assert batcher.budget.used == 0
    if runner == "paged":
        prompt_pages = len(requests[0].prompt) // target.page_size
        assert prompt_pages >= 4 and seen["shared"] == prompt_pages  # the prompt's full pages, held once
        assert target.kv.num_free_pages == target.kv.num_pages


def test_the_group_is_budgeted_once_and_refused_whole_when_it_cannot_fit(pair):
    tokenizer = pair[2]
    engine = _engine(pair, runner="paged", max_rows=4, cache_tokens=512)
    budget = engine.batcher.budget
    requests = _choices(tokenizer, LONG_PROMPT, 3, max_new=40)
    prompt_len = len(requests[0].prompt)
    one = budget.units(prompt_len, 40)
    assert budget.group_units(prompt_len, 40, 3) == 3 * one - 2 * (prompt_len // budget.page_size)
    engine.batcher.admit([(r, Collector(), 0.0) for r in requests])
    assert budget.used == budget.group_units(prompt_len, 40, 3)
    assert engine.batcher.target.kv.num_shared_pages == prompt_len // budget.page_size
    for row in list(engine.batcher.running):  # the leader first: the shared pages stay held until the last
        engine.batcher.end(row, CANCELLED)
        assert budget.used >= 0
    assert budget.used == 0 and engine.batcher.target.kv.num_free_pages == engine.batcher.target.kv.num_pages
    too_many = _choices(tokenizer, LONG_PROMPT, 4, max_new=100)
    with pytest.raises(RequestTooLargeError, match="n = 4 choices"):
        engine.submit_group(too_many, [Collector() for _ in too_many])


def test_a_leader_cancelled_during_its_chunked_prefill_hands_it_to_the_next_choice(pair):
    tokenizer = pair[2]
    engine = _engine(pair, runner="lean", max_rows=4, prefill_chunk=16)
    batcher = engine.batcher
    requests = _choices(tokenizer, LONG_PROMPT, 3)
    batcher.admit([(r, Collector(), 0.0) for r in requests])
    batcher.step()  # the leader's first chunk
    leader = batcher.rows[0]
    assert 0 < leader.prefilled < len(requests[0].prompt) and batcher.rows[1].prefilled == 0
    batcher.end(leader, CANCELLED)
    sinks = [batcher.rows[1].sink, batcher.rows[2].sink]
    while batcher.running:
        batcher.step()
    engine.start()
    try:
        alone = [_alone(engine, request) for request in requests[1:]]
    finally:
        engine.stop()
    assert [sink.wait().tokens for sink in sinks] == alone
    assert batcher.budget.used == 0


def test_n_3_over_http_shares_the_prompt_pages_while_the_choices_run(pair):
    """The official openai client asks n = 3 of the paged server; while the choices stream, /metrics shows the
    prompt's full pages shared (held once) and the pages in use below three separate prompts'."""
    from serve_utils import MODEL_NAME, make_app, metrics, openai_client, slow_target
    from specdec_ext.serve.server import ServerThread

    target, draft, tokenizer = pair
    app, engine = make_app(target, draft, tokenizer, runner="paged", max_rows=4, k=3, max_seq_len=256)
    prompt_pages = len(tokenizer(LONG_PROMPT)["input_ids"]) // engine.batcher.target.page_size
    server = ServerThread(app, engine, grace_s=5.0).start()
    try:
        client = openai_client(server)
        with slow_target(target, 0.05):  # (every choice runs for about a second after its first chunk)
            stream = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, n=3, max_tokens=48, stream=True,
                                               temperature=1.0, seed=5, extra_body={"ignore_eos": True})
            texts, started, seen = ["", "", ""], set(), None
            for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
                    started.add(choice.index)
                if seen is None and len(started) == 3:
                    seen = metrics(server)
        assert seen is not None
        shared = seen[("specdec_cache_pages_shared", ())]
        in_use = seen[("specdec_cache_pages_in_use", ())]
        assert shared == prompt_pages >= 4
        assert in_use < 3 * (prompt_pages + 1)  # three separate prompts would hold their full pages each
        assert len(set(texts)) == 3
    finally:
        server.stop()
