"""Speculation co-scheduled with continuous batching (issue 30): the server's draft length by load
(serve/draft_length.py) and chunked prefill (runners' extend_rows, serve/batcher.py).

The controller is tested on synthetic step costs (a memory-bound pass whose width is nearly free, a
compute-bound one whose time grows with its tokens); the engine end to end on the tiny pair: greedy
tokens equal generate()'s whatever k each step chose, a seeded sample equals itself alone, a long prompt
joins chunk by chunk while another row keeps emitting (the step log), and its tokens equal a whole-prompt
prefill's.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from specdec_ext import plain_generate
from specdec_ext.models import Models
from specdec_ext.runners import LeanLlamaRunner, RecomputeRunner
from specdec_ext.sampling import SamplingParams
from specdec_ext.serve import draft_length
from specdec_ext.serve.build import EngineOptions, build_engine
from specdec_ext.serve.draft_length import (CATCH_UP_HORIZON, EXPLORE, EXPLORE_EVERY, EXPLORE_OVERHEAD, HOLD_STEPS,
                                           MEASURED, PASS_FLOOR_MARGIN, PINNED, REFRESH, STALE_STEPS, CostCurve,
                                           DraftChoice, DraftCosts, FeedCost, LoadGatedK, PassFloor)
from specdec_ext.serve.request import GenerationRequest
from specdec_ext.serve.slo import TpotSlo
from specdec_ext.stats import StepOutcome
from specdec_ext.stops import StopCriteria
from serve_utils import tiny_pair
from test_serve_engine import Collector, _run_to_end

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module

K_MAX = 8
MS = 1e-3


# ------------------------------------------------------------------------------------------ the controller
def _simulate(controller: LoadGatedK, width: int, steps: int, verify_s, acceptance: float, rng,
              draft_s: float = 0.2 * MS, seeded=()):
    """Run ``steps`` choices at ``width`` rows with step costs verify_s(tokens in the pass) and
    draft_s per drafted token, each draft accepted with probability ``acceptance``; the choices."""
    return _simulate_rows(controller, [acceptance] * width, steps, verify_s, rng, draft_s, seeded)


def _simulate_rows(controller: LoadGatedK, acceptance, steps: int, verify_s, rng, draft_s: float = 0.2 * MS,
                   seeded=()):
    """``_simulate`` with one acceptance per row (``acceptance[b]``; the width is its length)."""
    running = list(range(len(acceptance)))
    choices = []
    for _ in range(steps):
        choice = controller.choose(len(acceptance), running, list(seeded))
        drafted = [choice.budget[b] for b in running]
        accepted = []
        for b, d in zip(running, drafted):
            n = 0
            while n < d and rng.random() < acceptance[b]:
                n += 1
            accepted.append(n)
        controller.observe(len(acceptance), choice, StepOutcome(running, drafted, accepted),
                           verify_width=choice.k + 1, draft_time=choice.k * draft_s,
                           verify_time=verify_s(len(acceptance) * (choice.k + 1)), host_time=0.05 * MS)
        choices.append(choice)
    return choices


def memory_bound(tokens: int) -> float:
    """A pass that reads the weights once: nearly flat in its tokens up to 16, then compute-bound."""
    return 10 * MS + 0.02 * MS * tokens + 0.5 * MS * max(tokens - 16, 0)


def test_k_by_load_speculates_on_a_narrow_batch_turns_off_on_a_wide_one_and_back_on_when_it_shrinks():
    """The regime map, measured: at one row a pass of 9 tokens costs about what a pass of 1 does, so with
    acceptance 0.8 the controller drafts long; at 32 rows a pass costs in proportion to its tokens and
    speculation turns off (plain steps); back at one row it turns on again."""
    rng = np.random.default_rng(0)
    controller = LoadGatedK(K_MAX, rows=32, pinned_k=4)
    narrow = _simulate(controller, 1, 60, memory_bound, 0.8, rng)
    assert np.mean([c.k for c in narrow[-20:]]) >= 5
    wide = _simulate(controller, 32, 80, memory_bound, 0.8, rng)
    tail = wide[-30:]
    assert sum(c.k == 0 for c in tail) >= 25, [c.k for c in tail]  # off, but for explorations
    assert all(c.k == 0 or c.reason == EXPLORE for c in tail)
    back = _simulate(controller, 1, 40, memory_bound, 0.8, rng)
    assert np.mean([c.k for c in back[-10:]]) >= 5


def test_low_acceptance_switches_speculation_off_and_explorations_keep_measuring():
    """A row whose drafts are never accepted gets plain steps; while off, a step every EXPLORE_EVERY
    steps (backing off) drafts to measure again."""
    rng = np.random.default_rng(1)
    controller = LoadGatedK(K_MAX, rows=4, pinned_k=4)
    choices = _simulate(controller, 1, 200, memory_bound, 0.0, rng)
    tail = choices[50:]
    assert sum(c.k == 0 for c in tail) > 0.9 * len(tail)
    explored = [i for i, c in enumerate(choices) if c.reason == EXPLORE]
    assert explored and min(np.diff(explored), default=EXPLORE_EVERY) >= EXPLORE_EVERY


def test_an_exploration_is_skipped_where_its_catch_up_outweighs_the_plain_steps_it_would_inform(monkeypatch):
    """While off, an exploration pays the whole catch-up (the deferred draft prefills of the rows that
    joined while off and every row's plain stretch) in one step: it is made only where that costs at most
    EXPLORE_OVERHEAD x the plain steps until the next one."""
    rng = np.random.default_rng(1)
    controller = LoadGatedK(K_MAX, rows=4, pinned_k=4)
    _simulate(controller, 1, 60, memory_bound, 0.0, rng)  # off, explorations backing off
    for _ in range(500):  # up to a step that explores
        if copy.deepcopy(controller).choose(1, [0], []).reason == EXPLORE:
            break
        _simulate(controller, 1, 1, memory_bound, 0.0, rng)
    else:
        pytest.fail("no exploration in 500 steps")
    catch_up = controller._catch_up_s(1, [0])
    bound = EXPLORE_OVERHEAD * controller._interval * controller.step_times(1)[0]
    assert 0 < catch_up <= bound
    for overhead, explores in [(EXPLORE_OVERHEAD, True), (0.9 * EXPLORE_OVERHEAD * catch_up / bound, False)]:
        monkeypatch.setattr(draft_length, "EXPLORE_OVERHEAD", overhead)
        assert (copy.deepcopy(controller).choose(1, [0], []).reason == EXPLORE) == explores, overhead


def test_the_catch_up_feed_is_a_fixed_part_and_a_time_per_token():
    """One feed timed: in proportion to its tokens; feeds of several sizes: the least-squares line, so a
    one-row feed's call overhead is not taken for a per-token cost (0.25 ms per token estimated where a
    233-token feed took 2.8 ms, measured)."""
    feed = FeedCost()
    assert feed.at(100) is None
    feed.observe(2, 0.5 * MS)
    assert feed.at(8) == pytest.approx(2.0 * MS)
    feed.observe(233, 2.8 * MS)
    assert feed.at(233) == pytest.approx(2.8 * MS) and feed.at(2) == pytest.approx(0.5 * MS)
    assert feed.at(466) == pytest.approx(2.8 * MS + 233 * (2.3 / 231) * MS)
    assert feed.per_token() == pytest.approx(2.3 / 231 * MS)  # the marginal token, not the call's overhead
    controller = LoadGatedK(K_MAX, rows=4, pinned_k=4)
    assert controller._feed_s(4, 0) == 0.0
    controller.feed = feed  # no draft prefill timed yet: a pending prompt token costs a fed token's slope
    assert controller._catch_up_s(4, [0], pending_tokens=100) == pytest.approx(100 * 2.3 / 231 * MS)


def compute_bound(tokens: int) -> float:
    """A pass whose time grows with its tokens: 8 rows drafting one token take 1.5x a plain step."""
    return 4 * MS + 0.5 * MS * tokens


@pytest.mark.parametrize("tolerance", [draft_length.ROW_LOSS_TOLERANCE, math.inf])
def test_no_row_is_slowed_below_its_plain_rate_for_the_batch_s_gain(monkeypatch, tolerance):
    """8 rows on a pass that costs in proportion to its tokens: at acceptance 0.9 everywhere drafting pays
    for every row and the controller drafts. When one row stops accepting, drafting still raises the
    batch's rate (seven rows gain a quarter) but runs that row at 2/3 of its plain rate: the controller
    turns plain (but for explorations); without the rule (tolerance inf) it goes on drafting."""
    monkeypatch.setattr(draft_length, "ROW_LOSS_TOLERANCE", tolerance)
    rng = np.random.default_rng(11)
    controller = LoadGatedK(K_MAX, rows=8, pinned_k=4)
    even = _simulate_rows(controller, [0.9] * 8, 60, compute_bound, rng)
    assert all(c.k >= 1 for c in even[-20:])
    uneven = _simulate_rows(controller, [0.9] * 7 + [0.0], 120, compute_bound, rng)
    tail = uneven[-40:]
    times, expected = controller.step_times(8), controller._expected_sums(list(range(8)))
    worst = controller._expected[7]  # (filled by _expected_sums)
    assert max(e / t for e, t in zip(expected[1:], times[1:])) > 1.1 * expected[0] / times[0]  # the batch would gain
    if math.isinf(tolerance):
        assert sum(c.k >= 1 for c in tail) >= 35
    else:
        assert all(worst[K] / times[K] < 0.9 / times[0] for K in range(1, K_MAX + 1))  # the row would lose
        assert sum(c.k == 0 for c in tail) >= 35 and all(c.k == 0 or c.reason == EXPLORE for c in tail)


def test_a_seeded_row_drafts_the_pinned_length_whatever_the_load():
    """Seeded rows' tokens must not depend on the load: they draft pinned_k every step even where the
    others are off."""
    rng = np.random.default_rng(2)
    controller = LoadGatedK(K_MAX, rows=32, pinned_k=4)
    choices = _simulate(controller, 32, 60, memory_bound, 0.8, rng, seeded=[3])
    assert all(c.budget[3] == 4 for c in choices)
    off = [c for c in choices[20:] if c.budget[0] == 0]
    assert off and all(c.reason == PINNED and c.k == 4 for c in off)


def test_a_clear_off_is_held_for_a_few_steps_while_the_rows_stay_the_same(monkeypatch):
    """Far from paying (a compute-bound pass at 32 rows), the choice to stay off is evaluated once per
    HOLD_STEPS steps while the running rows stay the same, and at once when a row joins or leaves."""
    rng = np.random.default_rng(5)
    controller = LoadGatedK(K_MAX, rows=32, pinned_k=4)
    _simulate(controller, 32, 80, memory_bound, 0.8, rng)  # measured: off
    evaluations = []
    step_times = controller._step_times  # (what choose evaluates)
    monkeypatch.setattr(controller, "_step_times", lambda width: evaluations.append(width) or step_times(width))
    choices = _simulate(controller, 32, 3 * HOLD_STEPS, memory_bound, 0.8, rng)
    assert all(c.k == 0 for c in choices) and len(evaluations) == 3, evaluations
    choice = controller.choose(32, list(range(31)), [])  # a row left
    assert len(evaluations) == 4 and choice.k == 0
    assert controller.choose(32, list(range(31)), [3]).budget[3] == 4  # a seeded row is never held off


def test_a_close_call_measures_plain_decoding_again_when_its_cost_is_stale():
    """While speculating where the choice is close (acceptance 0.45 on a pass whose time grows with its
    tokens) and plain's V(w) was last measured more than STALE_STEPS steps ago, one plain step
    (REFRESH) measures it again, and speculation goes on after it."""
    rng = np.random.default_rng(3)
    controller = LoadGatedK(K_MAX, rows=8, pinned_k=4)
    steep = lambda tokens: 10 * MS + 0.6 * MS * tokens
    choices = _simulate(controller, 2, 150, steep, 0.45, rng)
    refreshes = [i for i, c in enumerate(choices) if c.reason == REFRESH]
    assert refreshes and all(i > STALE_STEPS for i in refreshes)
    assert all(choices[i + 1].k > 0 for i in refreshes if i + 1 < len(choices))


def test_a_pass_after_a_prompt_chunk_is_not_timed_into_v_and_cannot_refresh_it():
    """A step whose pass follows a prompt chunk (its caches evicted) leaves V as it was: at 16 rows a plain
    pass timed at 6 ms stays the estimate when passes after chunks take 9 ms; and a close call whose V(w)
    is stale refreshes it only in a step without a chunk (where the plain pass can measure it)."""
    controller = LoadGatedK(K_MAX, rows=16, pinned_k=4)
    running = list(range(16))
    plain = DraftChoice(0, MEASURED, [0] * 16)
    for seconds, after in [(6 * MS, False)] * 3 + [(9 * MS, True)] * 5:
        controller.observe(16, plain, StepOutcome(running, [0] * 16, [0] * 16), verify_width=1, draft_time=0.0,
                           verify_time=seconds, host_time=0.05 * MS, after_prefill=after)
    assert controller.verify.at(16) == pytest.approx(6 * MS)
    controller.observe(16, plain, StepOutcome(running, [0] * 16, [0] * 16), verify_width=1, draft_time=0.0,
                       verify_time=9 * MS, host_time=0.05 * MS)
    assert controller.verify.at(16) > 6.5 * MS  # (the same time without a chunk before it is V's)

    rng = np.random.default_rng(3)
    controller = LoadGatedK(K_MAX, rows=8, pinned_k=4)
    steep = lambda tokens: 10 * MS + 0.6 * MS * tokens
    choices = _simulate(controller, 2, 150, steep, 0.45, rng)
    assert any(c.reason == REFRESH for c in choices)
    for _ in range(500):  # up to a step that refreshes V(2) ...
        if copy.deepcopy(controller).choose(2, [0, 1], []).reason == REFRESH:
            break
        _simulate(controller, 2, 1, steep, 0.45, rng)
    else:
        pytest.fail("no refresh in 500 steps")
    assert controller.choose(2, [0, 1], [], after_prefill=True).reason != REFRESH  # ... but for the chunk


def test_cost_curve_interpolates_and_extrapolates_optimistically():
    """Between the sizes seen: linear; outside: what looks cheapest within reason (flat above a single
    point, proportional below it; the end segments' slopes with two or more, never below proportional)."""
    curve = CostCurve(smoothing=1.0)
    assert curve.at(4) is None
    curve.observe(4, 2.0, step=1)
    assert curve.at(1) == pytest.approx(0.5) and curve.at(8) == 2.0
    curve.observe(8, 3.0, step=2)
    assert curve.at(6) == pytest.approx(2.5)
    assert curve.at(16) == pytest.approx(5.0)  # the last segment's slope
    assert curve.at(2) == pytest.approx(1.5)  # the first segment's slope (proportional would be 1.0)
    assert curve.at(1) == pytest.approx(1.25)
    curve.observe(8, 100.0, step=3)  # a spike counts as SPIKE_CAP x the average
    assert curve.times[8] == pytest.approx(6.0)
    assert curve.fresh(8, step=3) and not curve.fresh(4, step=2 + STALE_STEPS)


def test_the_pass_floor_is_the_dearest_time_per_token_of_the_chunks_at_least_as_long():
    """A pass of n tokens costs at least n x t(c) / c for every chunk of c >= n tokens timed (its time per
    token does not rise with its tokens), less PASS_FLOOR_MARGIN; nothing is known above the longest chunk."""
    floor = PassFloor(smoothing=1.0)
    assert floor.at(16) == 0.0
    floor.observe(256, 256 * 0.45 * MS)
    assert floor.at(144) == pytest.approx(PASS_FLOOR_MARGIN * 144 * 0.45 * MS)
    assert floor.at(257) == 0.0
    floor.observe(32, 32 * 0.6 * MS)  # a shorter chunk, dearer per token: it bounds the passes up to its length
    assert floor.at(32) == pytest.approx(PASS_FLOOR_MARGIN * 32 * 0.6 * MS)
    assert floor.at(33) == pytest.approx(PASS_FLOOR_MARGIN * 33 * 0.45 * MS)
    floor.observe(0, 1.0)
    floor.observe(8, 0.0)
    assert sorted(floor.per_token) == [32, 256]


def test_prompt_chunks_keep_a_wide_batch_from_trying_long_drafts_on_an_extrapolated_cost():
    """After one row's steps measured passes of 1..9 tokens only (memory-bound: nearly flat), a batch of 16
    rows extrapolates its verify cost from that flat segment and tries drafts that lose (the failure seen
    at 16 clients: K = 8 estimated at 2098 tok/s, run at 635, against plain's 1140). With the floor of
    a timed 256-token prompt chunk it drafts at most one token, in a few steps (K = 1 is a close call
    there: it measures it)."""
    drafted = {}
    for with_floor in (False, True):
        rng = np.random.default_rng(4)
        controller = LoadGatedK(K_MAX, rows=16, pinned_k=4)
        _simulate(controller, 1, 40, memory_bound, 0.8, rng)
        if with_floor:
            for _ in range(2):  # (the first chunk a controller sees is not timed: the process's first pass)
                controller.observe_prefill(256, memory_bound(256))
        drafted[with_floor] = [choice.k for choice in _simulate(controller, 16, 40, memory_bound, 0.8, rng)]
    assert max(drafted[False]) >= 4, drafted[False]
    assert max(drafted[True]) <= 1 and sum(k > 0 for k in drafted[True]) <= 3, drafted[True]


def test_joining_prompts_charge_every_draft_length_their_draft_prefill():
    """While speculating, each joining request pays the draft model's prefill of its prompt: every K >= 1
    is charged J (prompt tokens joining per step, a moving average) x the draft prefill's time per token,
    plain steps nothing. A K that beats plain decoding by a few percent stops paying once requests of
    250 tokens join every ten steps at 40 us a token."""
    rng = np.random.default_rng(6)
    controller = LoadGatedK(K_MAX, rows=8, pinned_k=4)
    steep = lambda tokens: 5 * MS + 0.55 * MS * tokens
    _simulate(controller, 4, 60, steep, 0.75, rng)
    before = controller.step_times(4)
    assert max(c.k for c in _simulate(controller, 4, 10, steep, 0.75, rng)) > 0
    controller.record_draft_prefill(250, 250 * 40e-6)
    for step in range(200):
        controller.record_joins(250 if step % 10 == 0 else 0)
    assert controller.join_tokens == pytest.approx(25.0, rel=0.3)
    after = controller.step_times(4)
    assert after[0] == before[0] and np.allclose(after[1:] - before[1:], controller.join_tokens * 40e-6, rtol=0.05)
    running = list(range(4))
    assert controller.choose(4, running, []).k == 0


def test_a_draft_prefill_of_a_few_tokens_is_not_timed():
    """A joining request's prompt of a few tokens costs its prefill call's fixed time: taken per token it
    priced every later join's draft prefill that many times too dear. It is not timed; a longer one is."""
    from specdec_ext.adaptive import MIN_TIMED_PREFILL_TOKENS
    controller = LoadGatedK(K_MAX, rows=8, pinned_k=4)
    controller.record_draft_prefill(3, 2.2e-3)
    assert math.isnan(controller.prefill_per_token)
    controller.record_draft_prefill(MIN_TIMED_PREFILL_TOKENS * 4, MIN_TIMED_PREFILL_TOKENS * 4 * 30e-6)
    assert controller.prefill_per_token == pytest.approx(30e-6)


def test_the_first_prefill_chunk_a_controller_sees_is_not_timed():
    controller = LoadGatedK(K_MAX, rows=2, pinned_k=4)
    controller.observe_prefill(64, 1.0)
    assert controller.floor.per_token == {}
    controller.observe_prefill(64, 64 * MS)
    assert controller.floor.per_token == {64: pytest.approx(MS)}


def test_draft_costs_fit_a_fixed_part_and_a_per_token_part_per_width():
    """D(w, K) = d_0 + K c per width (through the origin from one K); a width without data takes the
    nearest measured one's line."""
    costs = DraftCosts(smoothing=1.0)
    assert costs.line(1) is None
    costs.observe(1, 4, 4e-3)
    assert costs.line(1) == pytest.approx((0.0, 1e-3))
    costs.observe(1, 1, 2e-3)
    fitted = pytest.approx((4e-3 / 3, 2e-3 / 3))  # through (1, 2 ms) and (4, 4 ms)
    assert costs.line(1) == fitted
    costs.observe(8, 2, 6e-3)
    assert costs.line(6) == pytest.approx((0.0, 3e-3)) and costs.line(3) == fitted


def test_load_gated_k_refuses_a_pinned_length_outside_its_slots():
    with pytest.raises(ValueError, match="pinned_k must lie in"):
        LoadGatedK(4, rows=2, pinned_k=5)


# ------------------------------------------------------------------------------------------ extend_rows
@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.mark.parametrize("kind", ["lean", "recompute"])
def test_a_prompt_prefilled_in_chunks_leaves_what_a_whole_prefill_leaves(pair, kind):
    """start_rows(first chunk) + extend_rows(next chunks) against start_rows(whole prompt), beside another
    running row: the same last logits and the same logits of the next pass."""
    target = pair[0]
    make = (lambda: LeanLlamaRunner(target, max_batch_size=2, max_seq_len=128)) if kind == "lean" else (
        lambda: RecomputeRunner(target, max_batch_size=2, max_seq_len=128))
    prompt = [int(t) for t in torch.randint(1, 60, (50,), generator=torch.Generator().manual_seed(0))]
    other = [5, 6, 7]
    whole, chunked = make(), make()
    for runner in (whole, chunked):
        runner.start_rows([0], [other])
    last_whole = whole.start_rows([1], [prompt])
    chunked.start_rows([1], [prompt[:17]])
    chunked.extend_rows([1], [prompt[17:40]])
    last_chunked = chunked.extend_rows([1], [prompt[40:]])
    torch.testing.assert_close(last_chunked, last_whole, rtol=1e-5, atol=1e-5)
    assert whole.lengths.tolist() == chunked.lengths.tolist() == [3, 50]
    step = torch.tensor([[8, 9], [10, 11]])
    torch.testing.assert_close(chunked.forward(step), whole.forward(step), rtol=1e-5, atol=1e-5)


def test_extend_rows_refuses_a_free_row_an_empty_chunk_and_a_full_row(pair):
    runner = LeanLlamaRunner(pair[0], max_batch_size=2, max_seq_len=16)
    runner.start_rows([0], [[1, 2, 3]])
    with pytest.raises(ValueError, match="row 1 is not in use"):
        runner.extend_rows([1], [[4]])
    with pytest.raises(ValueError, match="chunk 0 is empty"):
        runner.extend_rows([0], [[]])
    with pytest.raises(ValueError, match="17 tokens, more than max_seq_len=16"):
        runner.extend_rows([0], [list(range(14))])
    assert runner.lengths.tolist() == [3]


# ------------------------------------------------------------------------------------------ the engine
def _engine(pair, **options):
    target, draft, tokenizer = pair
    models = Models(target, "model", draft=draft, tokenizer=tokenizer)
    return build_engine(models, EngineOptions(max_seq_len=256, **options))


def _request(tokenizer, prompt, *, max_new, sampling=SamplingParams(), seed=0, seeded=False):
    ids = prompt if isinstance(prompt, list) else tokenizer(prompt)["input_ids"]
    return GenerationRequest(list(ids), sampling, seed, StopCriteria(max_new, [], []), seeded=seeded)


def _run(engine, requests):
    return [sink.tokens for sink in _run_to_end(engine, requests)]


PROMPTS = ["def fib(n):\n    return", "import os\nimport sys\n", "x = [1, 2, 3]\nprint(x", "a", "class a:\n  def",
           "for i in range(10):\n    print(i)\n", "while True:\n  x", "y = {'a': 1}\n"]


def test_k_by_load_gives_every_greedy_request_its_plain_greedy_tokens(pair):
    """Eight greedy requests through four slots with the draft length by load (the default): each equals
    plain greedy decoding of its prompt alone; /metrics counts every step under a draft length."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=4)
    assert "k by load" in engine.description
    got = _run(engine, [_request(tokenizer, p, max_new=40) for p in PROMPTS])
    for prompt, tokens in zip(PROMPTS, got):
        want = plain_generate([prompt], pair[0], max_new_tokens=40, eos_token_id=False, tokenizer=tokenizer)
        assert tokens == want.token_ids[0], prompt
    batcher = engine.batcher
    steps = sum(1 for record in batcher.step_log if record.width)
    text = batcher.metrics.render({})
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("specdec_draft_length_steps_total{"))
    assert counted == steps > 0
    assert "specdec_speculation_off_steps_total" in text


def test_calibration_times_every_draft_length_then_forgets_its_request(pair):
    """Engine.calibrate (specdec serve's start-up request) runs its schedule before start(): afterwards
    V(t) is known for t = 1..k+1 tokens at width 1 and D(1, K) for every K, while the metrics, the step
    log's effect on /metrics and the rows' acceptance are as a fresh server's; greedy requests after it
    still equal plain greedy decoding."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=4)
    controller = engine.batcher.draft_length
    k = controller.k_max
    steps = engine.calibrate(tokenizer("import os\nimport sys\n")["input_ids"])
    assert steps == 2 * k + 3 and not controller.calibrating
    assert set(range(1, k + 2)) <= set(controller.verify.sizes)
    assert set(controller.draft.times[1]) == set(range(1, k + 1))
    assert not engine.batcher.running and not engine.metrics.finished and not engine.metrics.draft_lengths
    assert engine.metrics.steps.steps == 0
    assert np.allclose(controller.pooled, controller.pooled[0]) and controller.acceptance().shape == (4, k)
    assert controller.join_tokens == 0.0  # (its own prompt's join is not the clients')
    got = _run(engine, [_request(tokenizer, p, max_new=24) for p in PROMPTS[:3]])
    for prompt, tokens in zip(PROMPTS[:3], got):
        want = plain_generate([prompt], pair[0], max_new_tokens=24, eos_token_id=False, tokenizer=tokenizer)
        assert tokens == want.token_ids[0], prompt
    with pytest.raises(RuntimeError, match="before start"):
        engine.calibrate([1, 2, 3])
    assert _engine(pair, max_rows=2, k=3).calibrate([1, 2, 3]) == 0  # a fixed k: nothing to choose


def test_the_host_time_of_a_step_counts_the_choice_and_the_emission(pair):
    """H, the time a step of any k pays besides its draft and verify parts, is measured over the whole
    decode step: the controller's own choice (here 50 ms on the batcher's clock) and the emission of the
    last step's tokens (20 ms) are in it, not only the Stepper's bookkeeping."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=2)
    batcher, controller = engine.batcher, engine.batcher.draft_length
    now = [0.0]
    batcher.clock = lambda: now[0]
    choose, emit, hosts = controller.choose, batcher._emit, []

    def slow_choose(*args, **kwargs):
        now[0] += 0.05
        return choose(*args, **kwargs)

    def slow_emit(*args, **kwargs):
        now[0] += 0.02 / 2  # (two rows)
        return emit(*args, **kwargs)

    observe = controller.observe
    controller.choose, batcher._emit = slow_choose, slow_emit
    controller.observe = lambda *args, host_time, **kwargs: hosts.append(host_time) or observe(
        *args, host_time=host_time, **kwargs)
    _run(engine, [_request(tokenizer, p, max_new=12) for p in PROMPTS[:2]])
    assert len(hosts) >= 3
    assert all(h >= 0.04 for h in hosts), hosts  # the choice (less the real draft and verify times)
    assert any(h >= 0.06 for h in hosts[1:]), hosts  # ... and the last step's emission


def _scripted_run(pair, ks, *, deferrable=True):
    """Two greedy requests through an engine whose draft length follows the script ``ks`` (then 3);
    (tokens, the draft tokens owed at each step, the engine's step statistics)."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=2)
    engine.batcher.drafter.deferrable_start = deferrable
    controller = engine.batcher.draft_length
    scripted = iter(list(ks) + [3] * 200)
    owed = []
    choose = controller.choose

    def scripted_choose(width, running, seeded, *, pending_tokens=0, uniform=False, steps_left=None, after_prefill=False):
        choose(width, running, seeded, pending_tokens=pending_tokens)  # its bookkeeping, then the script
        owed.append(pending_tokens)
        k = next(scripted)
        controller._cap = k
        return DraftChoice(k, MEASURED, [k if b in running else 0 for b in range(width)])

    controller.choose = scripted_choose
    prefills, record = [], controller.record_draft_prefill
    controller.record_draft_prefill = lambda tokens, seconds: prefills.append(tokens) or record(tokens, seconds)
    got = _run(engine, [_request(tokenizer, p, max_new=40) for p in PROMPTS[:2]])
    assert prefills and not math.isnan(controller.prefill_per_token)  # every draft prefill is timed: at a join ...
    if deferrable and owed[len(ks)] > 0:  # ... or, deferred, at the first step that drafts (each row's committed
        assert owed[len(ks)] - 2 in prefills, (owed, prefills)  # tokens but its last, which the step feeds)
    return got, owed, engine.metrics.steps


def test_rows_joining_while_speculation_is_off_get_their_draft_prefill_when_a_step_drafts(pair):
    """While k by load has speculation off, a joining row's draft prefill waits (the drafter holds the row
    without its tokens, the controller is told the tokens it owes); the first step that drafts gives the
    drafter the rows' committed tokens first: the tokens equal plain greedy decoding and the drafts are
    accepted exactly as those of a drafter prefilled at the join (without the start the step fails:
    a held row cannot feed the tokens it missed)."""
    got, owed, steps = _scripted_run(pair, [0] * 6)
    for prompt, tokens in zip(PROMPTS[:2], got):
        want = plain_generate([prompt], pair[0], max_new_tokens=40, eos_token_id=False, tokenizer=pair[2])
        assert tokens == want.token_ids[0], prompt
    assert 0 < owed[0] < owed[6] and not any(owed[7:]), owed  # owed grows while off, paid at the first draft
    at_join, no_owed, reference = _scripted_run(pair, [0] * 6, deferrable=False)
    assert at_join == got and not any(no_owed)
    assert (steps.reached, steps.accepted) == (reference.reached, reference.accepted) and steps.accepted[0] > 0


def test_a_row_joining_while_off_is_held_by_the_drafter_without_a_draft_forward(pair):
    """Chunked prefill has the drafter hold a joining row (hold_rows: the draft runner spans it, no draft
    forward); where the row's draft prefill is deferred (speculation off), the drafter keeps holding it
    until the first step that drafts, which starts it with its committed tokens: one hold and one real
    start per row, no one-token stand-in prompt (each was a draft forward), and the tokens are still
    plain greedy decoding's."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=2)
    batcher, controller = engine.batcher, engine.batcher.draft_length
    assert batcher.prefill_chunk > 0
    calls = []
    drafter = batcher.drafter
    start_rows, hold_rows = drafter.start_rows, drafter.hold_rows

    def counted_start(rows, prompts, meta):
        calls.extend("stand-in" if len(p) == 1 else "prompt" for p in prompts)
        return start_rows(rows, prompts, meta)

    def counted_hold(rows, meta):
        calls.extend("hold" for _ in rows)
        return hold_rows(rows, meta)

    drafter.start_rows, drafter.hold_rows = counted_start, counted_hold
    scripted = iter([0] * 6 + [3] * 200)

    def scripted_choose(width, running, seeded, **_):
        k = next(scripted)
        controller._cap = k
        return DraftChoice(k, MEASURED, [k if b in running else 0 for b in range(width)])

    controller.choose = scripted_choose
    got = _run(engine, [_request(tokenizer, p, max_new=30) for p in PROMPTS[:2]])
    assert sorted(calls) == ["hold", "hold", "prompt", "prompt"], calls
    for prompt, tokens in zip(PROMPTS[:2], got):
        want = plain_generate([prompt], pair[0], max_new_tokens=30, eos_token_id=False, tokenizer=tokenizer)
        assert tokens == want.token_ids[0], prompt
    assert engine.metrics.steps.accepted[0] > 0  # it drafted after the plain steps


def test_speculation_back_on_after_more_plain_steps_than_the_draft_cache_holds(pair):
    """A long plain stretch (more steps than a row's positions) with rows joining and leaving, then
    speculation back on: the draft model catches each row up on its own arrears (drafter.catch_up), not
    on a feed as wide as the steps skipped (which outgrew the lean draft cache and failed every row of
    the step). Every request still gets its plain greedy tokens."""
    tokenizer = pair[2]
    target, draft, _ = pair
    engine = build_engine(Models(target, "model", draft=draft, tokenizer=tokenizer),
                          EngineOptions(max_seq_len=96, max_rows=2, prefill_chunk=0))
    assert engine.plan.draft_runner == "lean"
    controller = engine.batcher.draft_length
    requests = [_request(tokenizer, PROMPTS[i % len(PROMPTS)], max_new=24) for i in range(12)]
    state = {"steps": 0}

    def scripted_choose(width, running, seeded, *, pending_tokens=0, uniform=False, steps_left=None, after_prefill=False):
        state["steps"] += 1
        k = 0 if state["steps"] <= 130 else 3  # 130 plain steps > 96 positions, then drafting
        controller._cap = k
        return DraftChoice(k, MEASURED, [k if b in running else 0 for b in range(width)])

    controller.choose = scripted_choose
    got = _run(engine, requests)
    assert state["steps"] > 130 and engine.metrics.steps.accepted[0] > 0  # it drafted after the stretch
    for request, tokens in zip(requests, got):
        want = plain_generate([request.prompt], target, max_new_tokens=24, eos_token_id=False)
        assert tokens == want.token_ids[0]


def test_the_catch_up_is_counted_per_row_and_a_deferred_prefill_at_its_own_cost():
    """What switching speculation on owes: each running row's tokens committed in plain steps since the
    last draft pass (a row that joined while off is not counted again beside its deferred prefill), at the
    measured feed time per token, plus the deferred prefills' tokens at their measured time per token."""
    controller = LoadGatedK(K_MAX, rows=4, pinned_k=4)
    controller.feed.observe(10, 10e-3)  # (one feed timed: in proportion to the tokens)
    controller.prefill_per_token = 2e-4
    plain = lambda rows: controller.observe(len(rows), DraftChoice(0, MEASURED, [0] * len(rows)),
                                            StepOutcome(rows, [0] * len(rows), [0] * len(rows)), verify_width=1,
                                            draft_time=0.0, verify_time=10 * MS, host_time=0.0)
    for _ in range(5):
        plain([0, 1])
    controller.join(2)  # joins while off: its tokens are the batcher's pending tokens
    for _ in range(3):
        plain([0, 1, 2])
    assert controller._catch_up_s(3, [0, 1, 2], pending_tokens=300) == pytest.approx((8 + 8 + 3) * 1e-3 + 300 * 2e-4)
    assert controller._catch_up_s(3, [0, 1], pending_tokens=0) == pytest.approx(16 * 1e-3)
    controller.record_draft_prefill(1000, 0.3)
    assert controller.prefill_per_token == pytest.approx(0.7 * 2e-4 + 0.3 * 3e-4)  # a moving average (0.3)
    drafted = DraftChoice(2, MEASURED, [2, 2, 2])
    controller.observe(3, drafted, StepOutcome([0, 1, 2], [2, 2, 2], [1, 1, 1]), verify_width=3, draft_time=40 * MS,
                       verify_time=12 * MS, host_time=0.0)
    assert controller._catch_up_s(3, [0, 1, 2]) == 0.0  # the draft pass fed them


def test_a_catch_up_is_not_paid_for_rows_about_to_end():
    """Off after a wide stretch, one row left: with many tokens to go switching on repays the catch-up
    over CATCH_UP_HORIZON steps and speculation goes on; with 2 tokens left it could not, and the step
    stays plain."""
    def controller_after_a_wide_stretch():
        rng = np.random.default_rng(4)
        controller = LoadGatedK(K_MAX, rows=32, pinned_k=4)
        _simulate(controller, 1, 40, memory_bound, 0.8, rng)
        _simulate(controller, 32, 60, memory_bound, 0.8, rng)  # off: every row falls behind the draft model
        assert controller._cap == 0 and controller._catch_up_s(1, [0]) > 0
        controller.feed = FeedCost()
        controller.feed.observe(10, 20 * MS)  # 60 tokens behind: 120 ms to catch up
        return controller

    many = controller_after_a_wide_stretch().choose(1, [0], [], steps_left=200)
    few = controller_after_a_wide_stretch().choose(1, [0], [], steps_left=2)
    assert many.k > 0 and few.k == 0


def test_a_seeded_sample_equals_itself_alone_under_k_by_load(pair):
    """A seeded request at T = 1 returns the same tokens alone and beside seven others (greedy and
    unseeded samples) while the others' draft length follows the load."""
    tokenizer = pair[2]
    seeded = lambda: _request(tokenizer, PROMPTS[0], max_new=48, sampling=SamplingParams(1.0), seed=77, seeded=True)
    alone = _run(_engine(pair, max_rows=8), [seeded()])[0]
    others = [_request(tokenizer, p, max_new=48, sampling=SamplingParams(1.0 if i % 2 else 0.0), seed=i)
              for i, p in enumerate(PROMPTS[1:])]
    batched = _run(_engine(pair, max_rows=8), [others[0], others[1], seeded()] + others[2:])[2]
    assert batched == alone


def test_a_seeded_sample_under_k_by_load_returns_generates_tokens(pair):
    """A seeded request at T = 1 (pinned to FIXED_K drafts in the server's k_max-wide buffers) returns the tokens
    generate() gives it with k = FIXED_K: its draws do not depend on the buffers' width."""
    from specdec_ext import generate
    from specdec_ext.serve.build import FIXED_K

    target, draft, tokenizer = pair
    prompt = tokenizer("def fib(n):")["input_ids"]
    assert "k by load" in _engine(pair, max_rows=4).description
    for seed in (7, 8):
        served = _run(_engine(pair, max_rows=4), [_request(tokenizer, prompt, max_new=32, sampling=SamplingParams(1.0), seed=seed,
                                        seeded=True)])[0]
        alone = generate([prompt], target, draft, k=FIXED_K, max_new_tokens=32, temperature=1.0, seed=seed,
                         eos_token_id=False).token_ids[0]
        assert served == alone


def test_a_long_prompt_joins_in_chunks_while_a_running_row_keeps_emitting(pair):
    """A 200-token prompt with a chunk budget of 40 joins over several steps; the running row emits in
    every one of them (the step log), and the long request's tokens equal a whole-prompt prefill's and
    plain greedy decoding's."""
    target, _, tokenizer = pair
    long_prompt = tokenizer("for i in range(10):\n    print(i)\n" * 7)["input_ids"][:200]
    assert len(long_prompt) == 200
    engine = _engine(pair, max_rows=2, prefill_chunk=40)
    controller, waiting = engine.batcher.draft_length, []
    record_joins = controller.record_joins
    controller.record_joins = lambda tokens, pending=0: waiting.append(pending) or record_joins(tokens, pending)
    running, joining = Collector(), Collector()
    engine.submit(_request(tokenizer, PROMPTS[1], max_new=150), running)
    engine.start()
    try:
        running.next()  # its first token: it is decoding
        engine.submit(_request(tokenizer, long_prompt, max_new=20), joining)
        running.wait()
        joining.wait()
    finally:
        engine.stop()
    log = list(engine.batcher.step_log)
    chunks = [record for record in log if 1 in record.prefilled]
    assert len(chunks) >= 4 and sum(r.prefilled[1] for r in chunks) == 200
    assert all(record.emitted.get(0, 0) >= 1 for record in chunks), [(r.prefilled, r.emitted) for r in chunks]
    whole = _run(_engine(pair, max_rows=2, prefill_chunk=0), [_request(tokenizer, long_prompt, max_new=20)])[0]
    plain = plain_generate([long_prompt], target, max_new_tokens=20, eos_token_id=False).token_ids[0]
    assert joining.tokens == whole == plain
    assert waiting.count(200) >= 3 and waiting[-1] == 0  # the prompt's tokens count as joining while it prefills


def test_prompts_still_prefilling_charge_every_draft_length_their_draft_prefill():
    """J is at least the prompt tokens of the rows in their chunked prefill over CATCH_UP_HORIZON steps: a
    burst of joining prompts is charged before its rows join (the moving average of joins follows late)."""
    rng = np.random.default_rng(6)
    controller = LoadGatedK(K_MAX, rows=16, pinned_k=4)
    _simulate(controller, 2, 30, memory_bound, 0.8, rng)
    controller.prefill_per_token = 1e-4
    before = controller.step_times(2)
    controller.record_joins(0, 3200)  # 3200 prompt tokens prefilling, none joined this step
    after = controller.step_times(2)
    assert after[0] == before[0]
    np.testing.assert_allclose(after[1:] - before[1:], 3200 / CATCH_UP_HORIZON * 1e-4, rtol=1e-9)
    controller.record_joins(0, 0)
    np.testing.assert_allclose(controller.step_times(2), before, rtol=1e-9)


# ------------------------------------------------------------------------------------------ TPOT target
def test_tpot_slo_cuts_the_prefill_chunk_and_gates_admission_on_measured_times():
    """serve/slo.py: the chunk is what the target leaves after the decode step (at least the floor); a width
    whose measured time per token is above the target is not admitted (an unmeasured one is)."""
    slo = TpotSlo(0.050)
    assert slo.chunk_budget(256, 32, decoding=True) == 256  # prefill cost unmeasured
    slo.observe_prefill(100, 0.100)  # 1 ms per prompt token
    slo.observe_step(4, step_s=0.030, prefill_s=0.0, mean_tokens=2.0)  # 15 ms per token at width 4
    assert slo.chunk_budget(256, 32, decoding=True) == 70  # (50 ms x 2 tokens - 30 ms) / 1 ms
    assert slo.chunk_budget(256, 32, decoding=False) == 256  # nobody to stall
    slo.observe_step(8, step_s=0.100, prefill_s=0.060, mean_tokens=2.0)  # 80 ms per token at width 8
    assert slo.chunk_budget(256, 32, decoding=True) == 32  # nothing left: the floor
    assert slo.admits(4) and slo.admits(6) and not slo.admits(8) and not slo.admits(12)
    assert slo.admits(2)  # flat below the narrowest width measured
    assert slo.missed(0.051) and not slo.missed(0.049) and not slo.missed(None)
    with pytest.raises(ValueError, match="must be > 0"):
        TpotSlo(0.0)


def test_a_tpot_target_the_batch_cannot_meet_keeps_one_row_running_and_counts_the_misses(pair):
    """With a target no batch can meet (1 microsecond per token), requests that arrive while a row runs
    wait for it: every step covers one row; every request still gets its plain greedy tokens, and each
    one's miss is counted in /metrics."""
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=4, tpot_slo_ms=1e-3)
    assert "TPOT target" in engine.description
    first, rest = Collector(), [Collector() for _ in range(3)]
    engine.submit(_request(tokenizer, PROMPTS[0], max_new=30), first)
    engine.start()
    try:
        first.next()
        first.next()  # a step was measured
        for sink, prompt in zip(rest, PROMPTS[1:4]):
            engine.submit(_request(tokenizer, prompt, max_new=30), sink)
        for sink in [first] + rest:
            sink.wait()
    finally:
        engine.stop()
    assert {record.width for record in engine.batcher.step_log if record.width} == {1}
    for sink, prompt in zip([first] + rest, PROMPTS[:4]):
        want = plain_generate([prompt], pair[0], max_new_tokens=30, eos_token_id=False, tokenizer=tokenizer)
        assert sink.tokens == want.token_ids[0]
    assert "specdec_tpot_slo_misses_total 4" in engine.batcher.metrics.render({})


def test_a_loose_tpot_target_lets_the_batch_widen(pair):
    tokenizer = pair[2]
    engine = _engine(pair, max_rows=4, tpot_slo_ms=10_000)
    _run(engine, [_request(tokenizer, p, max_new=30) for p in PROMPTS[:4]])
    assert max(record.width for record in engine.batcher.step_log) == 4
    assert "specdec_tpot_slo_misses_total 0" in engine.batcher.metrics.render({})
