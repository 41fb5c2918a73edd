"""EAGLE-3 chains in the serving engine (issue 27): rows join and leave a running batch with their own draft
state (EagleDrafter.start_rows / free_rows; the target runner's taps written by its start_rows and chunked
extend_rows), and every request gets what generate() gives it alone: plain greedy when greedy, its seeded
tokens when sampled, on the lean and paged runners, with whole and chunked prefill, k fixed and by load."""
from __future__ import annotations

from typing import List

import pytest

import specdec_ext
from eagle_utils import random_head, tiny_target
from specdec_ext.eagle import EagleDrafterSpec
from specdec_ext.models import Models
from specdec_ext.sampling import SamplingParams
from specdec_ext.serve.build import EngineOptions, build_engine
from specdec_ext.serve.request import GenerationRequest
from specdec_ext.stops import StopCriteria
from serve_utils import serve_staggered
from test_generate_utils import hf_greedy

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

PROMPTS = [[5, 17, 3, 44, 9, 12, 61], [2, 30], [7] * 20 + [8, 9], [11, 12, 13], [40, 41, 42, 43, 44], [1]]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def head(target):
    return random_head(target, draft_vocab=48)


def _serve(target, head, requests, **options) -> List[List[int]]:
    """Submit ``requests`` to a started engine over the pair, two at a time at first and the rest as
    the first finish (rows join and leave a running batch); each one's tokens."""
    options = {"max_seq_len": 128, **options}
    engine = build_engine(Models(target, "eagle", draft=head), EngineOptions(**options))
    assert engine.plan.drafter == "eagle" and engine.plan.hidden_taps == tuple(head.config.layer_ids)
    assert engine.batcher.target.capabilities.hidden_taps and not engine.plan.cuda_graphs
    return serve_staggered(engine, requests)


def _request(prompt, max_new, sampling=SamplingParams(), seed=0, seeded=False):
    return GenerationRequest(list(prompt), sampling, seed, StopCriteria(max_new, [], []), seeded=seeded)


@pytest.mark.parametrize("options", [dict(k=3, runner="lean", max_rows=3),
                                     dict(k=4, runner="paged", max_rows=4),
                                     dict(runner="lean", max_rows=4, prefill_chunk=8),
                                     dict(k=2, runner="recompute", max_rows=2)])
def test_greedy_requests_get_plain_greedy(target, head, options):
    requests = [_request(p, 14) for p in PROMPTS]
    assert _serve(target, head, requests, **options) == [hf_greedy(target, p, 14) for p in PROMPTS]


def test_a_seeded_sampled_request_returns_what_generate_gives_it_alone(target, head):
    sampling = SamplingParams(0.9, 0, 0.95)
    requests = [_request(p, 12, sampling, seed=20 + i, seeded=True) for i, p in enumerate(PROMPTS[:4])]
    served = _serve(target, head, requests, k=3, runner="lean", max_rows=3)
    alone = [specdec_ext.generate([p], target, EagleDrafterSpec(head), k=3, max_new_tokens=12, temperature=0.9,
                                  top_p=0.95, seed=20 + i, eos_token_id=False).token_ids[0]
             for i, p in enumerate(PROMPTS[:4])]
    assert served == alone


def test_the_server_plan_names_the_taps(target, head):
    engine = build_engine(Models(target, "eagle", draft=head), EngineOptions(max_seq_len=128, max_rows=2))
    text = engine.plan.explain()
    assert "hidden taps" in text and "k by load" in text


def test_a_sampled_batch_that_widens_after_its_first_sampled_step(target, head):
    """The sampled draft's q buffer covers every slot: a first sampled step over one row, then two rows."""
    from serve_utils import Collector
    engine = build_engine(Models(target, "eagle", draft=head), EngineOptions(max_seq_len=128, max_rows=3, k=3,
                                                                             prefill_chunk=0))
    batcher, sampling = engine.batcher, SamplingParams(0.9)
    first = Collector()
    batcher.admit([(_request(PROMPTS[0], 12, sampling, seed=1, seeded=True), first, 0.0)])
    batcher.step()  # width 1
    second = Collector()
    batcher.admit([(_request(PROMPTS[1], 12, sampling, seed=2, seeded=True), second, 0.0)])
    while batcher.running:
        batcher.step()
    assert first.wait().reason == second.wait().reason == "length"
    assert len(first.tokens) == len(second.tokens) == 12


@pytest.mark.parametrize("runner", ["lean", "paged"])
def test_a_long_prompt_joins_beside_a_row_near_the_end_of_its_cache(target, head, runner):
    """The draft layer's feed writes its width at every row's fed position: an 84-token prompt joining
    (when the first request ends) while the second row has fed ~40 of its 96 positions is fed in passes
    that fit every row's cache (one pass would write past the second row's); all get plain greedy."""
    requests = [_request([2, 30], 35), _request([5, 17, 3, 44, 9], 80), _request(list(range(1, 85)), 2)]
    served = _serve(target, head, requests, k=3, runner=runner, max_rows=2, max_seq_len=96, prefill_chunk=0)
    assert served == [hf_greedy(target, r.prompt, r.stop.max_new_tokens) for r in requests]
