"""Adaptive k (specdec_ext/adaptive.py): the controller against a brute-force cost model, on simulated
acceptance and simulated costs (no models), then through the decode loop when the loop has the
adaptive hook: greedy output through k="auto" equals the target's greedy output (model and n-gram
drafters, every budget path: per-row budgets, the batch switched off, re-entry after a skip)."""
from __future__ import annotations

import dataclasses
import inspect
import math
import random

import numpy as np
import pytest
import torch

from specdec_ext import adaptive as ad
from specdec_ext.adaptive import AdaptiveK, ProbeRequest, expected_tokens_table, padded_batch_cap
from specdec_ext.stats import StepOutcome

V1 = 1e-3  # seconds of a one-token verify step in the simulations
SEGMENT = 8  # passes of a simulated plain chain segment (decode.PLAIN_CHAIN_TOKENS)


# ------------------------------------------------------------------------------------ helpers
def true_expected(acceptance, k):
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j, by a plain loop."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= acceptance[i]
        total += reach
    return total


def brute_force_best(acceptance, verify, c, k_max, tolerance=0.0):
    """argmax_k E(k) / (V(k+1) + k c) by enumeration (ties -> smaller k); with a tolerance the
    largest k whose rate is within it of the best (the padded controller's rule)."""
    rates = [true_expected(acceptance, k) / (verify(k + 1) + k * c) for k in range(k_max + 1)]
    if tolerance > 0:
        return int(max(k for k, r in enumerate(rates) if r >= max(rates) * (1 - tolerance))), rates
    return int(np.argmax(rates)), rates


class Simulator:
    """Drives a controller with simulated acceptance (per row, per position) and costs."""

    def __init__(self, controller, acceptance, verify, draft_cost, seed=0, noise=0.0, plain=None, host=0.0):
        self.c = controller
        self.acceptance = [list(a) for a in acceptance]  # [B][k_max] true a_i
        self.verify, self.draft_cost = verify, draft_cost
        self.plain, self.host = plain, host  # seconds per plain chain pass (None: the loop cannot chain), per step
        self.rng = random.Random(seed)
        self.noise = noise
        self.B = len(acceptance)
        controller.reset(self.B)
        if plain is not None:  # the loop chains plain decoding; its start-up probe measured P
            controller.plain_chain = SEGMENT
            controller.record_probes({}, {}, plain)
        self.drafter_calls = 0
        self.segments = 0

    def _jitter(self, t):
        return t * (1.0 + self.noise * (2 * self.rng.random() - 1))

    def step(self, active=None):
        active = [True] * self.B if active is None else active
        budget = self.c.plan(active)
        K = max(budget)
        if K == 0 and self.plain is not None:  # the loop runs a plain chain segment instead of a step
            self.segments += 1
            self.c.observe_plain(SEGMENT, self._jitter(SEGMENT * self.plain), active)
            return budget
        accepted = []
        for b in range(self.B):
            n = 0
            while n < budget[b] and self.rng.random() < self.acceptance[b][n]:
                n += 1
            accepted.append(n)
        self.drafter_calls += K > 0
        self.c.observe(budget, StepOutcome.of(accepted, budget, active), draft_time=self._jitter(K * self.draft_cost),
                       verify_time=self._jitter(self.verify(K + 1)), drafted=K, width=K + 1, host_time=self.host)
        return budget

    def run(self, steps, active=None):
        return [self.step(active) for _ in range(steps)]


def flat(t):
    return V1 * (1.0 + 0.01 * (t - 1))


def controller(k_max=8, **kw):
    kw.setdefault("explore_every", 16)
    return AdaptiveK(k_max, **kw)


# ------------------------------------------------------------------------------------ the maths
def test_expected_tokens_table_matches_the_geometric_formula_and_a_loop():
    a = 0.7
    table = expected_tokens_table(np.full((1, 6), a))
    for k in range(7):
        assert table[0, k] == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    decaying = np.array([[0.9, 0.8, 0.5, 0.2]])
    for k in range(5):
        assert expected_tokens_table(decaying)[0, k] == pytest.approx(true_expected(decaying[0], k))


def test_padded_batch_cap_is_the_brute_force_argmax():
    rng = np.random.default_rng(0)
    for _ in range(200):
        B, K = rng.integers(1, 5), rng.integers(1, 9)
        acc = rng.random((B, K))
        times = np.cumsum(rng.random(K + 1) * 0.5) + 0.5
        expected = expected_tokens_table(acc)
        active = rng.random(B) < 0.8
        cap = padded_batch_cap(expected, times, active)
        if not active.any():
            assert cap == 0
            continue
        rates = [sum(true_expected(acc[b], K2) for b in range(B) if active[b]) / times[K2] for K2 in range(K + 1)]
        assert rates[cap] == pytest.approx(max(rates))
        assert cap == min(K2 for K2 in range(K + 1) if rates[K2] >= max(rates) * (1 - 1e-12))  # ties -> smaller
        # with a tolerance: 0 when plain decoding is the best, else the longest cap within it of the best
        # cap >= 1 (the tolerance never favours speculating over plain decoding)
        spec = max(rates[1:])
        longest = 0 if rates[0] >= spec else max(K2 for K2 in range(1, K + 1) if rates[K2] >= spec * 0.95)
        assert padded_batch_cap(expected, times, active, 0.05) == longest


def test_controller_picks_the_argmax_of_the_cost_model_for_given_statistics():
    """Set the counts and the costs by hand: plan() is the brute-force argmax per row."""
    k_max = 6
    c = AdaptiveK(k_max, explore_every=0)
    c.reset(3)
    truth = [[0.9, 0.85, 0.8, 0.7, 0.6, 0.5], [0.5] * 6, [0.95, 0.3, 0.3, 0.3, 0.3, 0.3]]
    c.reached[:] = 1e6  # so many observations that the prior does not matter
    c.accepted[:] = np.array(truth) * 1e6
    c.costs.probe[1:] = [flat(t) for t in range(1, k_max + 2)]
    c.draft_per_token = 0.08 * V1
    preferred = []
    tolerance = ad.LONGER_TOLERANCE
    for b in range(3):  # a row alone in the batch gets its own argmax
        best, _ = brute_force_best(truth[b], flat, 0.08 * V1, k_max, tolerance)
        alone = c.plan([i == b for i in range(3)])
        assert alone[b] == best and sum(alone) == best, (b, alone, best)
        preferred.append(best)
    assert preferred[0] > preferred[2] >= 1  # a decaying acceptance is captured (row 2 stops early)
    # together they share one pass of width K + 1 where every row drafts K (a shorter row saves
    # nothing): K maximises the batch's tokens per second
    def time(k):
        return flat(k + 1) + k * 0.08 * V1
    rates = [sum(true_expected(truth[b], K) for b in range(3)) / time(K) for K in range(k_max + 1)]
    cap = int(max(K for K, r in enumerate(rates) if r >= max(rates) * (1 - tolerance)))
    assert c.plan([True] * 3) == [cap] * 3
    assert c.plan([True, False, True])[1] == 0  # finished rows draft nothing


# ------------------------------------------------------------------------------------ convergence
def test_converges_to_a_large_k_with_high_acceptance_and_cheap_drafts():
    c = controller()
    sim = Simulator(c, [[0.9] * 8], flat, 0.02 * V1)
    sim.run(300)
    best, rates = brute_force_best([0.9] * 8, flat, 0.02 * V1, 8)
    assert best >= 6
    chosen = sim.run(50)
    mean_rate = np.mean([rates[b[0]] for b in chosen])
    assert mean_rate >= 0.95 * rates[best]
    assert np.mean([b[0] for b in chosen]) >= 5


def test_converges_to_zero_when_drafts_are_expensive():
    c = controller(explore_every=0)
    sim = Simulator(c, [[0.7] * 8], flat, 1.0 * V1)  # a draft token costs a target step
    sim.run(100)
    assert sim.run(20) == [[0]] * 20


def test_converges_to_zero_when_acceptance_is_zero_and_stops_calling_the_drafter():
    c = controller(explore_every=16)
    sim = Simulator(c, [[0.0] * 8] * 2, flat, 0.05 * V1)
    sim.run(60)
    calls = sim.drafter_calls
    plans = sim.run(160)
    assert sum(max(p) == 0 for p in plans) >= 150  # speculation off for the batch...
    assert 0 < sim.drafter_calls - calls <= 160 // 16 + 1  # ...but for explorations (documented)
    calls = sim.drafter_calls
    sim.run(320)  # fruitless explorations back off to one per EXPLORE_BACKOFF * explore_every steps
    assert 0 < sim.drafter_calls - calls <= 320 // (ad.EXPLORE_BACKOFF * 16) + 1


def test_switches_the_batch_off_when_verify_cost_grows_steeply_with_tokens():
    """Per row, row 0 would speculate; with 4 rows sharing a pass whose cost grows 30% per token,
    the batch is better off plain (the regime-map crossover, from measured costs)."""
    def steep(t):
        return V1 * (1.0 + 0.3 * (t - 1))

    truth = [[0.9] * 8, [0.0] * 8, [0.0] * 8, [0.0] * 8]
    best0, _ = brute_force_best(truth[0], steep, 0.02 * V1, 8, ad.LONGER_TOLERANCE)
    assert best0 > 0  # alone, row 0 would speculate
    c = controller(explore_every=0)
    c.reset(4)
    c.reached[:] = 1e6
    c.accepted[:] = np.array(truth) * 1e6
    c.costs.probe[1:] = [steep(t) for t in range(1, 10)]
    c.draft_per_token = 0.02 * V1
    assert c.plan([True] * 4) == [0, 0, 0, 0]
    assert c.plan([True, False, False, False])[0] == best0  # alone again: on

    # and learnt from simulated steps, batch of 4 rows of high acceptance: linear verify cost -> off
    def linear(t):
        return V1 * t

    c = controller(explore_every=0)
    sim = Simulator(c, [[0.9] * 8] * 4, linear, 0.02 * V1)
    sim.run(100)
    assert sim.run(20) == [[0, 0, 0, 0]] * 20


def test_the_crossover_is_measured_online_without_a_probe():
    """No probe: V(t) is learnt from the widths the loop runs; with a steep cost the batch goes off."""
    c = controller(explore_every=8)
    truth = [0.4] * 8
    steep = lambda t: V1 * (1.0 + 0.5 * (t - 1))  # noqa: E731
    assert brute_force_best(truth, steep, 0.02 * V1, 8)[0] == 0
    sim = Simulator(c, [truth] * 3, steep, 0.02 * V1)
    sim.run(200)
    assert sum(max(p) == 0 for p in sim.run(40)) >= 30


def test_rows_are_independent():
    """Each row's statistics come from its own outcomes only: one width for the batch, the weak row
    rides along in the padded pass, and its acceptance is still estimated from its own outcomes."""
    padded = controller()
    sim = Simulator(padded, [[0.95] * 8, [0.35] * 8], flat, 0.1 * V1, seed=1)
    sim.run(300)
    assert all(p[0] == p[1] >= 4 for p in sim.run(40))
    assert abs(padded.acceptance()[0, 0] - 0.95) < 0.1
    assert abs(padded.acceptance()[1, 0] - 0.35) < 0.25

    # the same observations of row 0 alone give row 0 the same estimate, whatever row 1 did
    solo, pair = AdaptiveK(4, explore_every=0), AdaptiveK(4, explore_every=0)
    solo.reset(1)
    pair.reset(2)
    rng = random.Random(3)
    for _ in range(50):
        d0, n0 = rng.randint(0, 4), None
        n0 = rng.randint(0, d0)
        d1 = rng.randint(0, 4)
        n1 = rng.randint(0, d1)
        solo.observe([d0], StepOutcome.of([n0], [d0], [True]), draft_time=0.0, verify_time=V1, drafted=d0,
                     width=d0 + 1)
        pair.observe([d0, d1], StepOutcome.of([n0, n1], [d0, d1], [True, True]), draft_time=0.0, verify_time=V1,
                     drafted=max(d0, d1), width=max(d0, d1) + 1)
    assert np.allclose(solo.acceptance()[0], pair.acceptance()[0])


def test_exploration_recovers_after_a_regime_change():
    c = controller(explore_every=16, explore_k=2)
    sim = Simulator(c, [[0.0] * 8], flat, 0.05 * V1, seed=2)
    sim.run(200)
    assert sim.run(10) == [[0]] * 10 or max(max(p) for p in sim.run(10)) <= 2
    sim.acceptance = [[0.95] * 8]  # the text became repetitive
    plans = sim.run(100)
    first_on = next(i for i, p in enumerate(plans) if p[0] >= 3)
    # within the longest exploration interval (fruitless explorations backed it off), plus a few
    # steps to climb (follow-up explorations, then replans)
    assert first_on <= ad.EXPLORE_BACKOFF * 16 + 8, [p[0] for p in plans]
    assert np.mean([p[0] for p in plans[-20:]]) >= 4

    # and back: acceptance collapses -> speculation switches off again, within a few windows of the
    # acceptance counts (1 / (1 - g) = 20 steps): drafts here cost 5% of a pass per token, so
    # speculating pays until the estimate of a_1 falls to a few percent
    sim.acceptance = [[0.0] * 8]
    plans = sim.run(100)
    assert sum(p[0] == 0 for p in plans[-20:]) >= 18, [p[0] for p in plans]


def test_noisy_times_still_give_a_near_optimal_rate():
    truth = [0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5]
    c = controller()
    sim = Simulator(c, [truth], flat, 0.15 * V1, noise=0.3, seed=5)
    sim.run(300)
    _, rates = brute_force_best(truth, flat, 0.15 * V1, 8)
    chosen = sim.run(100)
    assert np.mean([rates[p[0]] for p in chosen]) >= 0.95 * max(rates)


# ------------------------------------------------------------------------------------ plain decoding at its own cost
def steep(t):
    """A compute-bound verify pass (the AVX2 path): each token costs a quarter of a one-token pass."""
    return V1 * (1.0 + 0.25 * (t - 1))


def known(acceptance, verify, draft_cost, *, plain=None, host=0.0, k_max=8, B=1):
    """A controller whose statistics and costs are set by hand (so many observations that the prior does
    not matter): V probed at every width, c per draft token, H, and P (the loop chains; just measured)
    unless None."""
    c = AdaptiveK(k_max, explore_every=0)
    c.reset(B)
    c.reached[:] = 1e6
    c.accepted[:] = np.array(acceptance) * 1e6
    c.costs.probe[1:] = [verify(t) for t in range(1, k_max + 2)]
    c.draft_per_token = draft_cost
    c.costs.host = host
    if plain is not None:
        c.plain_chain = SEGMENT
        c.record_probes({}, {}, plain)
        c.costs.plain_obs, c.costs.plain_obs_step = plain, c.costs.step
    return c


def test_speculation_is_measured_against_the_plain_path_the_loop_runs():
    """Issue 25: the same acceptance and step costs; against the loop's one-token step (V(1) + H)
    speculating pays, against greedy plain chains 1.4x faster per token it does not (0: a plain
    segment), and the choice flips exactly where 1 / P crosses the best E(k) / time(k) (while off,
    where (1 + SWITCH_ON_MARGIN) / P does)."""
    a, c_draft, H = [0.6] * 8, 0.1 * V1, 0.3 * V1
    step_loop = known([a], steep, c_draft, host=H)
    assert step_loop.plan([True])[0] >= 1
    assert step_loop.step_times()[0] == pytest.approx(steep(1) + H)  # k = 0 is the loop's one-token step
    chained = known([a], steep, c_draft, host=H, plain=(V1 + H) / 1.4)
    assert chained.plan([True]) == [0]
    assert chained.step_times()[0] == pytest.approx((V1 + H) / 1.4)
    best = max(true_expected(a, k) / (steep(k + 1) + k * c_draft + H) for k in range(1, 9))
    for plain in np.linspace(0.8, 1.2, 17) / best:
        off = known([a], steep, c_draft, host=H, plain=plain)  # speculation off: it must beat plain by the margin
        assert (off.plan([True])[0] == 0) == ((1 + ad.SWITCH_ON_MARGIN) / plain >= best), plain * best
        on = known([a], steep, c_draft, host=H, plain=plain)
        on._speculating = True  # speculating: it stays on while it beats plain at all
        assert (on.plan([True])[0] == 0) == (1.0 / plain >= best), plain * best


def test_the_noise_guards_never_favour_speculating_over_plain_decoding():
    """The longest-cap tolerance and the hysteresis choose among K >= 1 only: plain decoding within 2%
    above a draft length, or the cap in use, still switches speculation off; while off, speculation
    must beat plain decoding by the switch-on margin."""
    def cap(rates, **kw):
        return padded_batch_cap(np.array([rates]), np.ones(len(rates)), np.array([True]), **kw)
    assert cap([1.0, 0.95, 0.99, 0.995], tolerance=0.02) == 0
    assert cap([1.0, 0.95, 0.99, 0.995], tolerance=0.02, current=3, margin=0.04) == 0
    assert cap([0.9, 0.95, 1.0, 0.99], tolerance=0.02) == 3  # the longest within 2% of the best K >= 1
    assert cap([0.9, 0.95, 1.0, 0.99], tolerance=0.02, current=1, margin=0.06) == 1  # kept: within 6%, beats plain
    assert cap([0.96, 0.95, 1.0, 0.99], tolerance=0.02, current=1, margin=0.06) == 3  # not kept: below plain
    assert cap([1.0, 1.04, 1.03], switch_on=0.05) == 0  # off: speculation must beat plain by the margin
    assert cap([1.0, 1.06, 1.03], switch_on=0.05) == 1


def test_host_time_between_steps_counts_against_speculation():
    """H is paid once per step: the same rates with H = 0 speculate, with a measured H they do not."""
    a = [0.5] * 8
    assert known([a], flat, 0.1 * V1, plain=V1).plan([True])[0] >= 1
    assert known([a], flat, 0.1 * V1, plain=V1, host=0.6 * V1).plan([True]) == [0]
    learnt = known([a], flat, 0.1 * V1, plain=V1)
    learnt.costs.host = float("nan")
    for _ in range(20):  # observe() learns H from the loop's measured gaps
        learnt.observe([1], StepOutcome.of([1], [1], [True]), draft_time=0.1 * V1, verify_time=flat(2), drafted=1,
                       width=2, host_time=0.6 * V1)
    assert learnt.costs.host == pytest.approx(0.6 * V1)
    learnt._times = None
    assert learnt.plan([True]) == [0]


def test_plain_segments_run_while_they_beat_speculation_and_it_switches_back_when_costs_or_acceptance_change():
    """Simulated loop that chains: a = 0.6 on a compute-bound verify loses to plain chains -> almost every
    iteration is a plain segment (and the drafter is called only to explore); the plain path becoming
    slower (measured by its segments) -> speculation back on; then acceptance collapsing -> off again,
    and recovering -> on again through the explorations."""
    c = controller(explore_every=16)
    sim = Simulator(c, [[0.6] * 8], steep, 0.1 * V1, plain=0.8 * V1, host=0.2 * V1, seed=3)
    sim.run(30)
    calls, segments = sim.drafter_calls, sim.segments
    plans = sim.run(60)
    assert sum(max(p) == 0 for p in plans) >= 45 and sim.segments - segments >= 45
    # the drafter is called to explore (a run of accepted explorations may switch speculation on for a few
    # steps: a = 0.6 is near break-even here, and the estimate then overshoots)
    assert sum(max(p) > c.explore_k for p in plans) <= 6, [p[0] for p in plans]
    assert c.plain_time() == pytest.approx(0.8 * V1)
    sim.plain = 1.15 * V1  # the plain path got slower (measured by its segments; still below V(1) + H)
    plans = sim.run(40)
    # (on again; a = 0.6 is near break-even here, and a run of rejections may switch it off for a step or two)
    assert sum(p[0] >= 1 for p in plans[-20:]) >= 17, [p[0] for p in plans]
    sim.acceptance = [[0.0] * 8]
    plans = sim.run(60)
    assert sum(p[0] == 0 for p in plans[-20:]) >= 18, [p[0] for p in plans]
    sim.acceptance = [[0.97] * 8]
    plans = sim.run(80)
    assert np.mean([p[0] for p in plans[-20:]]) >= 4, [p[0] for p in plans]


def test_while_speculating_a_stale_plain_cost_is_measured_again_where_the_choice_is_close():
    """P from long ago (another process may have slowed or sped up the cores since): where speculating
    wins by less than REFRESH_BAND, one plain segment measures P again before the choice; where it wins
    by more, no segment runs (a stale P cannot change that choice)."""
    def stale(acceptance, plain):
        c = known([acceptance], flat, 0.1 * V1, plain=plain)
        c._speculating = True
        c.costs.step += ad.COST_MEMORY_STEPS + 1
        return c

    def best_over_plain(c):
        times, expected = c.step_times(), expected_tokens_table(c.acceptance())[0]
        return max(expected[1:] / times[1:]) * times[0]

    close = stale([0.3] * 8, 1.0 * V1)
    assert 1.0 < best_over_plain(close) < 1 + ad.REFRESH_BAND
    assert close.plan([True]) == [0]  # a refresh segment...
    close.observe_plain(SEGMENT, SEGMENT * 1.0 * V1, [True])
    assert close.plan([True])[0] >= 1  # ...then the choice, at once (P fresh, and no switch-on margin)
    clear = stale([0.9] * 8, 1.0 * V1)
    assert best_over_plain(clear) > 1 + ad.REFRESH_BAND
    assert clear.plan([True])[0] >= 1  # no segment
    sim = Simulator(controller(explore_every=0), [[0.9] * 8], flat, 0.1 * V1, plain=1.0 * V1, seed=4)
    sim.run(200)
    assert sim.segments <= 1  # speculating clearly pays: P is never measured again (the probe may be, once)


def test_while_off_the_step_costs_follow_the_load_the_plain_segments_see():
    """Speculation off after a stretch on (acceptance fell); another process doubles every cost: the
    segments measure P doubling, and the step costs (last measured while speculating) follow it, so
    speculation stays off; unscaled, the old step costs would have looked cheap against the new P and
    switched it on at a loss."""
    c = controller(explore_every=0)
    sim = Simulator(c, [[0.9] * 8], steep, 0.1 * V1, plain=1.0 * V1, host=0.2 * V1, seed=5)
    c.record_probes({t: steep(t) for t in (1, 2, 4, 9)}, {})
    assert all(p[0] >= 1 for p in sim.run(40)[-10:])  # high acceptance: speculating
    sim.acceptance = [[0.45] * 8]
    plans = sim.run(60)
    assert all(p == [0] for p in plans[-10:])  # low acceptance: off
    before = c.step_times()
    load = 2.0
    sim.verify, sim.draft_cost, sim.host, sim.plain = (lambda t: load * steep(t)), load * sim.draft_cost, \
        load * sim.host, load * sim.plain
    assert all(p == [0] for p in sim.run(30))
    after = c.step_times()
    assert after[0] == pytest.approx(load * before[0], rel=0.05)
    assert after[1:] == pytest.approx(load * before[1:], rel=0.05)
    c.costs.step_plain = float("nan")  # (unscaled: the old step costs against the doubled P)
    times, expected = c.step_times(), expected_tokens_table(c.acceptance())[0]
    assert max(expected[1:] / times[1:]) > (1 + ad.SWITCH_ON_MARGIN) / times[0]


def test_no_exploration_starts_with_fewer_tokens_left_than_the_longest_interval():
    """An off generation explores at explore_every, but never with fewer tokens left than the longest
    interval (too few to use what it would find, or to repay the drafter's prefill)."""
    longest = ad.EXPLORE_BACKOFF * 16
    c = known([[0.3] * 8], steep, 0.5 * V1, plain=0.9 * V1)
    c.explore_every = 16
    c._explore_interval, c._next_explore = 16, 15  # (reset's state, kept by known())
    for step in range(15):
        assert c.plan([True], remaining=500) == [0]
        c.observe_plain(1, 0.9 * V1, [True])
    assert c.plan([True], remaining=longest - 1) == [0]  # due, but too few tokens left
    assert c.plan([True], remaining=longest) == [c.explore_k]
    fresh = AdaptiveK(8)
    fresh.reset(1)
    assert fresh._next_explore == 15


def test_a_deferred_drafter_prefill_must_be_repaid_by_what_speculating_saves():
    """While the drafter's prefill is deferred, speculation switches on only where the time it saves
    over the passes left exceeds that prefill at its measured cost per token."""
    a = [0.8] * 8
    c = known([a], flat, 0.1 * V1, plain=V1)
    cap = c.plan([True], remaining=64)[0]
    assert cap >= 1
    times, expected = c.step_times(), expected_tokens_table(c.acceptance())[0]
    saved = 64 * times[0] * (1 - (expected[0] / times[0]) / (expected[cap] / times[cap]))  # seconds
    per_token = 0.05 * V1
    for tokens, on in ((int(0.9 * saved / per_token), True), (int(1.1 * saved / per_token), False)):
        c = known([a], flat, 0.1 * V1, plain=V1)
        c.record_prefill(per_token * 100, 100)
        assert (c.plan([True], remaining=64, prefill=tokens)[0] > 0) == on, tokens
    c = known([a], flat, 0.1 * V1, plain=V1)
    c.record_prefill(per_token * 100, 100)
    assert c.plan([True], remaining=640, prefill=int(1.1 * saved / per_token))[0] > 0  # a longer generation repays it


def test_a_prefill_of_a_few_tokens_is_not_timed_into_the_cost_per_token():
    """A drafter prefill shorter than MIN_TIMED_PREFILL_TOKENS (a warm-up on a 3-token prompt) costs the call's
    fixed time: taken per token it priced a 128-token prefill at 66 ms, which no short generation repays, and
    speculation never switched on. It is not timed; a window's prefill is."""
    c = known([[0.8] * 8], flat, 0.1 * V1, plain=V1)
    c.record_prefill(2.19e-3, 3)
    assert c.prefill_per_token is None
    assert c.plan([True], remaining=64, prefill=128)[0] > 0  # (unmeasured: the prefill costs nothing)
    c.record_prefill(0.83e-3, ad.MIN_TIMED_PREFILL_TOKENS * 2)
    assert c.prefill_per_token == pytest.approx(0.83e-3 / (ad.MIN_TIMED_PREFILL_TOKENS * 2))


def test_start_asks_for_the_plain_chain_probe_once_and_record_probes_keeps_it():
    target = torch.nn.Linear(1, 1)
    first = AdaptiveK(4)
    request = first.start(1, target, ("model", 1), plain_chain=SEGMENT)
    assert request.plain_passes == SEGMENT
    first.record_probes({t: flat(t) for t in (1, 2, 4, 5)}, {}, 0.7 * V1)
    assert first.plain_time() == pytest.approx(0.7 * V1) and first.step_times()[0] == pytest.approx(0.7 * V1)
    second = AdaptiveK(4)
    assert second.start(1, target, ("model", 1), plain_chain=SEGMENT).plain_passes == 0  # shared
    assert second.plain_time() == pytest.approx(0.7 * V1)
    unchained = AdaptiveK(4)
    assert unchained.start(1, target, ("model", 1)).plain_passes == 0  # (sampling: the loop cannot chain)
    assert unchained.plain_time() is None
    second.observe_plain(SEGMENT, SEGMENT * 2.0 * V1, [True])  # the first passes after the prefill: cold
    assert second.plain_time() == pytest.approx(0.7 * V1)
    second.observe_plain(SEGMENT, SEGMENT * 0.9 * V1, [True])  # observed segments replace the probe
    assert second.plain_time() == pytest.approx(0.9 * V1)
    # a stop's short tail pays a chain call's fixed cost over fewer passes: counted, but not P
    second.observe_plain(1, 2.5 * V1, [True])
    second.observe_plain(SEGMENT - 1, (SEGMENT - 1) * 1.2 * V1, [True])
    assert second.plain_time() == pytest.approx(0.9 * V1)
    assert second.summary()["plain_chain_passes"] == 3 * SEGMENT
    assert second.summary()["speculation_off_steps"] == 3 * SEGMENT


# ------------------------------------------------------------------------------------ probe, helpers
class FakeRunner:
    """lengths / forward / truncate with a cost that grows with the width (time is simulated)."""

    def __init__(self, B, clock):
        self._lengths = torch.full((B,), 5, dtype=torch.int64)
        self.clock = clock
        self.widths = []

    @property
    def lengths(self):
        return self._lengths

    def forward(self, input_ids, num_tokens=None):
        B, T = input_ids.shape
        self.widths.append(T)
        self.clock.t += V1 * (1 + 0.5 * (T - 1))
        return torch.zeros((B, T, 7))

    def truncate(self, new_lengths):
        assert torch.equal(new_lengths, self._lengths)


class FakeClock:
    t = 0.0

    def now(self):
        return self.t


class FakeMeta:
    def __init__(self, B, k):
        self.batch_size, self.slots = B, k
        self.token_buffer = torch.arange(B * 16).view(B, 16)
        self.seq_lens = torch.full((B,), 6, dtype=torch.int64)
        self.verify_logits = None

    def pending_tokens(self):
        return torch.gather(self.token_buffer, 1, (self.seq_lens - 1)[:, None])


def test_probe_times_the_widths_and_leaves_the_cache_as_it_was():
    from specdec_ext.probes import probe_costs
    clock = FakeClock()
    runner = FakeRunner(2, clock)
    c = AdaptiveK(4)
    c.reset(2)
    times, draft_times = probe_costs(runner, None, FakeMeta(2, 4), ProbeRequest((1, 2, 4, 5), ()), clock, 3)
    assert sorted(times) == [1, 2, 4, 5] and draft_times == {}
    for t, s in times.items():
        assert s == pytest.approx(V1 * (1 + 0.5 * (t - 1)))
    c.record_probes(times, draft_times)
    verify = c.verify_times()
    assert verify[2] == pytest.approx(V1 * 2.0)  # t = 3 interpolated between 2 and 4
    assert (np.diff(verify) >= 0).all()
    # a steep probe alone switches a high-acceptance batch of rows off before the first step
    c.reached[:] = 1e6
    c.accepted[:] = 0.5e6
    c.draft_per_token = 0.05 * V1
    assert c.plan([True, True]) == [0, 0]


def test_cost_lines_fit_the_measurements_and_ignore_noise_in_the_order_of_points():
    c = AdaptiveK(8)
    c.reset(1)
    # verify: a probe (forward only) plus observed steps that cost 0.5 V1 more (verifier, commit)
    line = lambda t: V1 * (1.0 + 0.1 * (t - 1))  # noqa: E731
    for t in (1, 2, 4, 9):
        c.costs.probe[t] = line(t)
    c.costs.probe_curve = None
    for _ in range(40):
        for width in (6, 7):
            c.observe([width - 1], StepOutcome.of([0], [width - 1], [True]), draft_time=0.0,
                      verify_time=line(width) + 0.5 * V1, drafted=0, width=width)
    verify = c.verify_times()
    assert verify == pytest.approx([line(t) + 0.5 * V1 for t in range(1, 10)], rel=0.02)
    # noisy points, one high in the middle: the line stays monotone and close, no kink at the outlier
    noisy = AdaptiveK(8)
    noisy.reset(1)
    noisy.costs.obs[1:10] = [line(t) * f for t, f in zip(range(1, 10), [1, 1.05, 0.97, 1.3, 1, 0.98, 1.02, 1, 1])]
    noisy.costs.obs_step[1:10] = 0
    fitted = noisy.verify_times()
    assert (np.diff(fitted) >= 0).all() and fitted[-1] < line(9) * 1.1
    # draft: probed steps of 1, 3 and 8 tokens with a fixed part; the loop then runs 6 and 7 only
    d = AdaptiveK(8)
    d.reset(1)
    affine = lambda s: 0.6 * V1 + 0.3 * V1 * s  # noqa: E731
    for s in (1, 3, 8):
        d.draft_probe[s] = affine(s)
    for s in (6, 7):
        d.draft_obs[s] = affine(s)
    d.draft_obs_step[:] = d.costs.step  # (observed just now)
    assert d.draft_times() == pytest.approx([0.0] + [affine(s) for s in range(1, 9)])
    lone = AdaptiveK(8)  # no probe, one count observed: through the origin
    lone.reset(1)
    lone.draft_obs[4] = 4 * V1
    lone.draft_obs_step[4] = lone.costs.step
    assert lone.draft_times() == pytest.approx([s * V1 for s in range(9)])


def test_the_model_drafter_probe_times_draft_steps_and_leaves_the_cache_as_it_was(tiny_pair):
    from specdec_ext.decode import prefill
    from specdec_ext.probes import probe_costs
    from specdec_ext.drafters import ModelDrafter
    from specdec_ext.metadata import SpecDecodeMetadata
    from specdec_ext.plan import required_cache_len
    from specdec_ext.runners import make_runner
    from specdec_ext.sampling import SamplingParams
    target_model, draft_model = tiny_pair
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    S = required_cache_len(5, 8, 6)
    target = make_runner("lean", target_model, max_batch_size=2, max_seq_len=S)
    drafter = ModelDrafter(draft_model, lambda **kw: make_runner("lean", draft_model, **kw), k=6, vocab_size=64)
    meta = SpecDecodeMetadata.allocate(batch_size=2, slots=6, max_seq_len=S, sampling=SamplingParams(),
                                       seeds=torch.zeros(2, dtype=torch.int64))
    prefill(target, drafter, prompts, meta)
    lengths = drafter.runner.lengths.clone()
    reference = drafter.propose(meta).token_ids.clone()
    drafter.runner.truncate(lengths)
    clock = FakeClock()
    forward = drafter.runner.forward

    def timed_forward(*args, **kwargs):  # each draft forward costs V1 on the fake clock
        clock.t += V1
        return forward(*args, **kwargs)

    chain = drafter.runner.greedy_chain

    def timed_chain(tokens, steps, **kwargs):  # ... and so does a greedy chain's feed and each token past the first
        clock.t += (steps - 1 + (kwargs.get("feed") is not None)) * V1
        return chain(tokens, steps, **kwargs)

    drafter.runner.forward = timed_forward
    drafter.runner.greedy_chain = timed_chain
    verify_times, times = probe_costs(target, drafter, meta, ProbeRequest((), (1, 3, 6)), clock, 3)
    assert verify_times == {}
    assert times == pytest.approx({1: V1, 3: 3 * V1, 6: 6 * V1})  # the feed pass, then one per token
    assert torch.equal(drafter.runner.lengths, lengths)
    assert torch.equal(drafter.propose(meta).token_ids, reference)  # the same proposal as before the probe
    drafter.runner.truncate(lengths)
    c = AdaptiveK(6)
    c.reset(2)
    c.record_probes({}, {1: V1, 6: 6 * V1})
    assert c.draft_probe[1] == pytest.approx(V1) and c.draft_probe[6] == pytest.approx(6 * V1)
    assert np.isnan(c.draft_probe[2])


def test_start_asks_for_the_probes_once_per_target_and_batch_size_and_later_rows_start_from_the_pooled_acceptance():
    target = torch.nn.Linear(1, 1)  # the key of the shared state (weakly referenced)
    drafter = ("model", 1)
    first = AdaptiveK(4)
    request = first.start(2, target, drafter)
    assert request == ProbeRequest((1, 2, 3, 4, 5), (1, 2, 3, 4))
    first.record_probes({t: flat(t) for t in request.verify_widths}, {s: 0.05 * V1 * s for s in request.draft_counts})
    sim = Simulator(first, [[0.9, 0.9, 0.5, 0.2]] * 2, flat, 0.05 * V1)
    sim.run(100)
    first.finish()
    second = AdaptiveK(4)
    assert second.start(2, target, drafter) == ProbeRequest((), ())  # shared: no second probe
    assert second.costs is first.costs
    assert second.draft_per_token == first.draft_per_token
    assert second.draft_probe[3] == pytest.approx(0.15 * V1)
    assert np.allclose(second.acceptance()[0], first.acceptance().mean(axis=0), atol=0.1)
    other = AdaptiveK(4)  # another drafter: the costs are shared, the draft probe and acceptance prior are not
    assert other.start(2, target, ("model", 2)) == ProbeRequest((), (1, 2, 3, 4))
    assert other.costs is first.costs and other.draft_per_token is None
    assert other.acceptance()[0, 0] == pytest.approx(ad.DEFAULT_PRIOR_ACCEPTANCE)
    assert other.start(3, target, drafter).verify_widths == (1, 2, 3, 4, 5)  # another batch size: its own costs
    unshared = AdaptiveK(4, share_costs=False)
    assert unshared.start(2, target, drafter) == ProbeRequest((1, 2, 3, 4, 5), (1, 2, 3, 4))
    assert AdaptiveK(4).start(5, target, drafter, probe=False) == ProbeRequest((), ())  # every row finished


def test_a_table_made_without_probes_asks_the_next_generation_for_them():
    """A generation whose rows all finished at the prefill (max_new_tokens=1, an EOS first token) starts with
    probe=False and leaves the shared cost table without probes: the next generation that runs asks for
    the verify widths (it used to ask only when it made the table, so every later generation in the
    process decided on unmeasured verify costs, drafting k_max, and generate() probed a plain step
    per call)."""
    target = torch.nn.Linear(1, 1)
    drafter = ("model", 1)
    assert AdaptiveK(4).start(2, target, drafter, probe=False) == ProbeRequest((), ())
    later = AdaptiveK(4)
    request = later.start(2, target, drafter)
    assert request == ProbeRequest((1, 2, 3, 4, 5), (1, 2, 3, 4))
    later.record_probes({t: flat(t) for t in request.verify_widths}, {s: 0.05 * V1 * s for s in request.draft_counts})
    assert AdaptiveK(4).start(2, target, drafter) == ProbeRequest((), ())  # probed once: shared from then on


def test_after_a_generation_that_ended_at_its_prefill_k_auto_still_measures_its_costs(tiny_pair):
    """Through generate(): a one-token generation first, then one that runs: its controller has measured
    verify costs (the fit), and generate() needs no plain-step probe of its own."""
    from specdec_ext import generate
    from test_generate_utils import one_thread
    target, draft = tiny_pair
    ad._SHARED.pop(target, None)
    with one_thread():
        first = generate([[1, 2, 3]], target, draft, max_new_tokens=1, eos_token_id=False)
        assert first.stats.adaptive["verify_time_by_width_s"] is None  # nothing ran, nothing measured
        later = generate([[1, 2, 3]], target, draft, max_new_tokens=12, eos_token_id=False)
    widths = later.stats.adaptive["verify_time_by_width_s"]
    assert widths is not None and all(w > 0 for w in widths)
    assert later.stats.target_step_time == pytest.approx(widths[0])  # V(1), not a probe of its own


def test_no_row_drafts_more_than_it_may_still_emit(tiny_pair):
    """plan() caps every budget at remaining - 1 (a step emits its accepted drafts and one more; no row
    may emit more than ``remaining``); through generate(), no step of a short generation is wider than
    the tokens it had left, and the tokens are still the target's greedy ones."""
    c = known([[0.99] * 8], flat, 0.01 * V1, plain=V1)
    assert max(c.plan([True], remaining=500)) == 8
    assert c.plan([True], remaining=3) == [2]
    assert c.plan([True], remaining=1) == [0]
    assert c.plan([True, False], remaining=2) == [1, 0]
    from specdec_ext import generate
    from test_generate_utils import hf_greedy, one_thread
    target, draft = tiny_pair
    ad._SHARED.pop(target, None)
    with one_thread():
        ref = hf_greedy(target, [5, 6, 7], 3)
        generate([[5, 6, 7]], target, draft, max_new_tokens=12, eos_token_id=False)  # (probes)
        result = generate([[5, 6, 7]], target, draft, max_new_tokens=3, eos_token_id=False)
    assert result.token_ids == [ref]
    assert max(result.stats.adaptive["steps_by_width"]) <= 2  # after the first token, 2 left: a step of 1 draft


def test_a_pooled_prior_gives_the_shape_and_deep_positions_follow_the_rows_own_first_position():
    """A generation after high-acceptance ones starts from their pooled acceptance, but on a prompt of low
    acceptance its deep positions follow position 1 at once (in the pool's shape), not the pool's values:
    E(8) within a few steps of the truth, so speculation stops paying in the estimate as it does in fact."""
    c = AdaptiveK(8, explore_every=0)
    c.reset(1)
    pool = np.array([0.8, 0.85, 0.9, 0.92, 0.94, 0.95, 0.95, 0.96])
    c.set_prior(pool)
    assert c.acceptance()[0] == pytest.approx(pool)  # before data: the pool
    rng = random.Random(0)
    for _ in range(6):  # the prompt accepts 0.5 at every position
        n = 0
        while n < 8 and rng.random() < 0.5:
            n += 1
        c.observe([8], StepOutcome.of([n], [8], [True]), draft_time=0.0, verify_time=V1, drafted=8, width=9)
    estimate = expected_tokens_table(c.acceptance())[0, 8]
    assert estimate < 0.75 * true_expected(pool, 8) and abs(estimate - true_expected([0.5] * 8, 8)) < 1.0


def test_costs_are_kept_across_generations_of_one_batch_size_only():
    c = AdaptiveK(4)
    c.reset(2)
    c.costs.probe[1] = V1
    c.reset(2)
    assert c.costs.probe[1] == V1
    c.reset(3)
    assert np.isnan(c.costs.probe[1])


def test_resolve_and_bad_arguments():
    k, ctrl = ad.resolve("auto")
    assert k == ad.DEFAULT_K_MAX and isinstance(ctrl, AdaptiveK)
    assert ad.resolve(3) == (3, None)
    mine = AdaptiveK(5)
    assert ad.resolve(mine) == (5, mine)
    for bad in ("fast", 0, -1, True, 2.5):
        with pytest.raises(ValueError):
            ad.resolve(bad)
    for kw in (dict(prior_acceptance=1.5), dict(forgetting=0.0), dict(prior_strength=0.0), dict(cost_smoothing=0)):
        with pytest.raises(ValueError):
            AdaptiveK(4, **kw)
    with pytest.raises(ValueError):
        AdaptiveK(0)


def test_the_knobs_come_as_options_or_as_keywords():
    options = ad.AdaptiveOptions(explore_every=0, probe_widths=(1, 3, 99), probe_passes=5)
    c = AdaptiveK(4, options=options, probe_passes=2)  # a keyword replaces that field of the options
    assert (c.explore_every, c.probe_widths, c.probe_passes) == (0, [1, 3], 2)
    assert AdaptiveK(4, explore_every=0).explore_every == 0 and AdaptiveK(4).explore_every == ad.DEFAULT_EXPLORE_EVERY
    with pytest.raises(ValueError):
        ad.AdaptiveOptions(forgetting=1.5)
    with pytest.raises(TypeError):
        AdaptiveK(4, no_such_knob=1)


def test_widen_logits_keeps_the_static_buffer():
    from specdec_ext.step import widen_logits
    meta = FakeMeta(2, 4)
    logits = torch.randn(2, 3, 7)
    out = widen_logits(meta, logits)
    assert out.shape == (2, 5, 7) and torch.equal(out[:, :3], logits)
    again = widen_logits(meta, torch.randn(2, 2, 7))
    assert again.data_ptr() == out.data_ptr()




class FixedLogits:
    """A target whose pass returns the given logits [B, t, V] cut to the input's width."""

    def __init__(self, logits):
        self.logits = logits

    def forward(self, tokens, num_tokens, tree_parents=None):
        return self.logits[:, : tokens.shape[1]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_pass_without_drafts_verifies_its_rows_unwidened(temperature):
    """step.verify of ``meta.no_drafts``: the [B, 1, V] logits are verified as they are against [B, 0] drafts
    (greedy rows: the argmax into ``plain_tokens``; no [B, n+1, V] buffer made); a sampling row draws its token
    from Philox column num_draft = 0, the column the same rows use in a pass n + 1 wide."""
    from specdec_ext.metadata import SamplingParams, SpecDecodeMetadata
    from specdec_ext.step import lossless_verify, verify
    B, n, V = 3, 4, 11
    meta = SpecDecodeMetadata.allocate(batch_size=B, slots=n, max_seq_len=16, sampling=SamplingParams(temperature),
                                       seeds=torch.arange(B, dtype=torch.int64))
    logits = torch.randn(B, n + 1, V, generator=torch.Generator().manual_seed(0))
    verdict = verify(FixedLogits(logits), meta, meta.no_drafts, lossless_verify)
    assert verdict.num_accepted.tolist() == [0] * B
    if temperature == 0.0:
        assert verdict.tokens is meta.plain_tokens and meta.verify_logits is None
        assert verdict.tokens[:, 0].tolist() == logits[:, 0].argmax(-1).tolist()
        return
    assert meta.verify_logits is None and verdict.tokens.shape == (B, 1)
    drafted = dataclasses.replace(meta.no_drafts, longest=None)  # the same rows in a pass n + 1 wide
    wide = verify(FixedLogits(logits), meta, drafted, lossless_verify)
    assert wide.tokens[:, 0].tolist() == verdict.tokens[:, 0].tolist()


# ------------------------------------------------------------------------------------ through the loop
class RandomBudgets(AdaptiveK):
    """Every path of the loop: random per-row budgets, all-zero steps (drafter skipped, several in a
    row, then re-entry with a wide catch-up feed)."""

    def __init__(self, k_max, seed=0, skip=0.35, low=0):
        super().__init__(k_max)
        self.rng = random.Random(seed)
        self.skip, self.low = skip, low

    def plan(self, active, remaining=None, prefill=0, context=None):
        if self.rng.random() < self.skip:
            return [0] * len(active)
        return [self.rng.randint(self.low, self.k_max) if a else 0 for a in active]


@pytest.fixture(scope="module")
def tiny_pair():
    from test_generate_utils import noisy_copy, tiny_model
    target = tiny_model("llama", vocab=64, hidden=32, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, 0.2)


def test_the_model_drafter_after_many_skipped_steps_feeds_committed_tokens_only(tiny_pair):
    """A frozen long row and an active short one: after 22 skipped steps the feed is 24 columns wide,
    past the long row's tokens to the buffer's last column (-1 here: no token id); it used to reach the
    embedding. The proposals equal those of a drafter prefilled with the committed tokens."""
    from specdec_ext.decode import prefill
    from specdec_ext.drafters import ModelDrafter
    from specdec_ext.metadata import SpecDecodeMetadata
    from specdec_ext.plan import required_cache_len
    from specdec_ext.runners import make_runner
    from specdec_ext.sampling import SamplingParams
    target_model, draft_model = tiny_pair
    prompts = [list(range(1, 21)), [9, 8, 7]]
    S = required_cache_len(20, 8, 6)
    target = make_runner("lean", target_model, max_batch_size=2, max_seq_len=S)
    factory = lambda **kw: make_runner("lean", draft_model, **kw)  # noqa: E731
    skipping = ModelDrafter(draft_model, factory, k=6, vocab_size=64)
    meta = SpecDecodeMetadata.allocate(batch_size=2, slots=6, max_seq_len=S, sampling=SamplingParams(),
                                       seeds=torch.zeros(2, dtype=torch.int64))
    prefill(target, skipping, prompts, meta)
    meta.token_buffer[:, -1] = -1  # what lies past a row's tokens is no token id
    for step in range(22):  # adaptive k skips the drafter; the target emits one token for row 1 per step
        skipping.skip(meta)
        meta.token_buffer[1, meta.seq_lens[1]] = 10 + step % 40
        meta.seq_lens[1] += 1
    assert skipping.runner.lengths.tolist()[0] + 2 + 22 > S - 1  # the feed's columns pass the buffer's end
    proposed = skipping.propose(meta).token_ids.clone()
    assert skipping.runner.lengths.tolist() == (meta.seq_lens + 5).tolist()
    fresh = ModelDrafter(draft_model, factory, k=6, vocab_size=64)
    lengths = meta.seq_lens.tolist()
    fresh.prefill([meta.token_buffer[b, : lengths[b] - 1].tolist() for b in range(2)], meta)
    assert torch.equal(fresh.propose(meta).token_ids, proposed)


def test_a_windowed_draft_prefill_drafts_as_a_drafter_given_the_window_alone(tiny_pair):
    """prefill_window over 40 committed tokens with a window of 12 proposes, after skipped steps and a
    commit, exactly what a drafter prefilled with those 12 tokens alone proposes over a buffer holding
    them alone (its cache positions count from the window's start: the same relative positions); the
    cache lengths differ by the offset throughout."""
    from specdec_ext.drafters import ModelDrafter
    from specdec_ext.metadata import SpecDecodeMetadata, Verdict
    from specdec_ext.runners import make_runner
    from specdec_ext.sampling import SamplingParams
    _, draft_model = tiny_pair
    factory = lambda **kw: make_runner("lean", draft_model, **kw)  # noqa: E731
    committed = [(7 * i + 3) % 60 + 1 for i in range(41)]  # 40 fed at the prefill, the 41st pending
    window, offset = 12, 40 - 12
    metas, drafters = [], []
    for tokens in (committed, committed[offset:]):
        meta = SpecDecodeMetadata.allocate(batch_size=1, slots=4, max_seq_len=80, sampling=SamplingParams(),
                                           seeds=torch.zeros(1, dtype=torch.int64))
        meta.token_buffer[0, : len(tokens)] = torch.tensor(tokens)
        meta.seq_lens[0] = len(tokens)
        meta.target_input[0, 0] = tokens[-1]
        metas.append(meta)
        drafters.append(ModelDrafter(draft_model, factory, k=4, vocab_size=64))
    drafters[0].prefill_window([committed[:40]], metas[0], window)
    drafters[1].prefill([committed[offset:40]], metas[1])
    assert drafters[0].runner.lengths.tolist() == drafters[1].runner.lengths.tolist() == [window]
    for step in range(3):  # plain steps the drafter skips, then a proposal that catches up
        for meta, drafter in zip(metas, drafters):
            drafter.skip(meta)
            meta.token_buffer[0, meta.seq_lens[0]] = 5 + step
            meta.seq_lens[0] += 1
    proposals = [d.propose(m).token_ids.clone() for d, m in zip(drafters, metas)]
    assert torch.equal(proposals[0], proposals[1])
    for meta, drafter in zip(metas, drafters):  # two drafts accepted and a bonus token: 3 committed
        meta.num_kept.fill_(3)
        meta.token_buffer[0, meta.seq_lens[0]: meta.seq_lens[0] + 3] = torch.tensor([*proposals[0][0, :2].tolist(), 9])
        meta.seq_lens[0] += 3
        drafter.commit(meta, Verdict(meta.output_tokens, torch.tensor([2], dtype=torch.int32)))
    assert drafters[0].runner.lengths.tolist() == drafters[1].runner.lengths.tolist()  # the same tokens kept
    assert torch.equal(drafters[0].propose(metas[0]).token_ids, drafters[1].propose(metas[1]).token_ids)


class LookThenSpeculate(AdaptiveK):
    """Plain segments, one look at call ``look_at`` (an exploration while off), plain segments, then
    speculation from call ``switch_on`` on; records the drafter prefills it is told of (tokens) and how
    many steps had drafted before each."""

    def __init__(self, k_max, switch_on=5, look_at=3):
        super().__init__(k_max)
        self.calls, self.switch_on, self.look_at = 0, switch_on, look_at
        self.prefills, self.prefilled_after = [], []

    def plan(self, active, remaining=None, prefill=0, context=None):
        self.calls += 1
        self._speculating = self.calls >= self.switch_on
        k = 3 if self._speculating else (1 if self.calls == self.look_at else 0)
        return [k if a else 0 for a in active]

    def record_prefill(self, seconds, tokens):
        self.prefills.append(tokens)
        self.prefilled_after.append(self._drafted_steps)
        super().record_prefill(seconds, tokens)


def run_look(tiny_pair, controller):
    """Two rows longer than a look's window through decode with ``controller`` (after a warm-up that runs
    the start-up probes, which prefill the drafter whole): (rows, stats, drafter, plain greedy's tokens)."""
    from specdec_ext import plain_generate
    from specdec_ext.decode import LOOK_WINDOW
    from specdec_ext.drafters import ModelDrafter
    from specdec_ext.runners import make_runner
    from test_generate_utils import one_thread
    target, draft = tiny_pair
    prompts = [[(5 * i + 1) % 63 + 1 for i in range(LOOK_WINDOW + 20)], [9, 8, 7] * 15]
    with one_thread():
        plain = plain_generate(prompts, target, max_new_tokens=40, eos_token_id=False)
        def fresh():
            return ModelDrafter(draft, lambda **kw: make_runner("lean", draft, **kw), k=4, vocab_size=64)
        run_decode(target, fresh(), prompts, AdaptiveK(4), 4)
        drafter = fresh()
        rows, stats = run_decode(target, drafter, prompts, controller, 40)
    return rows, stats, drafter, plain.token_ids


def test_a_look_prefills_the_draft_with_a_window_and_speculation_with_the_whole_context(tiny_pair):
    """k="auto"'s first look at a long prompt prefills the draft model with the last LOOK_WINDOW committed
    tokens of each row; the first step that speculates prefills it with every committed token (its
    cache offsets back to 0); the greedy tokens are plain greedy's throughout."""
    from specdec_ext.decode import LOOK_WINDOW
    controller = LookThenSpeculate(4)
    rows, stats, drafter, plain = run_look(tiny_pair, controller)
    assert [r.tokens for r in rows] == plain
    assert controller.prefills[0] == 2 * LOOK_WINDOW  # the look: each row's window
    assert len(controller.prefills) == 2 and controller.prefills[1] > 2 * (LOOK_WINDOW + 20)  # then everything
    assert drafter._offsets.tolist() == [0, 0]
    assert stats.adaptive["plain_chain_passes"] > 0 and stats.draft_time > 0


def test_speculation_on_the_prior_alone_drafts_from_a_window_for_its_first_steps(tiny_pair):
    """A generation that speculates from its first step (the prior's word, before the rows' own counts)
    drafts from the look's window for its first LOOK_STEPS drafting steps, then prefills the whole
    context; the greedy tokens are plain greedy's."""
    from specdec_ext.adaptive import LOOK_STEPS
    from specdec_ext.decode import LOOK_WINDOW
    controller = LookThenSpeculate(4, switch_on=1, look_at=None)
    rows, _, _, plain = run_look(tiny_pair, controller)
    assert [r.tokens for r in rows] == plain
    assert controller.prefills[0] == 2 * LOOK_WINDOW and controller.prefilled_after == [0, LOOK_STEPS]



@pytest.mark.parametrize("controller_kind", ["auto", "random"])
def test_greedy_through_adaptive_k_equals_the_target_greedy(tiny_pair, controller_kind):
    from specdec_ext import generate
    from test_generate_utils import hf_greedy, one_thread
    target, draft = tiny_pair
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [3, 3, 3, 3, 3, 3]]
    with one_thread():
        refs = [hf_greedy(target, p, 40) for p in prompts]
        k = "auto" if controller_kind == "auto" else RandomBudgets(6, seed=1)
        result = generate(prompts, target, draft, max_new_tokens=40, k=k, eos_token_id=False)
    assert result.token_ids == refs
    assert result.stats.adaptive is not None
    if controller_kind == "random":
        widths = result.stats.adaptive["steps_by_width"]
        assert widths.get(1, 0) > 0 and len(widths) > 2  # skipped steps and several widths ran


def test_greedy_through_adaptive_k_with_the_ngram_drafter(tiny_pair):
    from specdec_ext.decode import LoopConfig, decode
    from specdec_ext.drafters import NgramDrafter
    from specdec_ext.plan import required_cache_len
    from specdec_ext.runners import make_runner
    from specdec_ext.sampling import SamplingParams
    from specdec_ext.stops import RowState, StopCriteria
    from test_generate_utils import hf_greedy, one_thread
    target, _ = tiny_pair
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 1, 2, 1, 2, 1]]
    for ctrl in (AdaptiveK(6), RandomBudgets(6, seed=4)):
        with one_thread():
            refs = [hf_greedy(target, p, 30) for p in prompts]
            S = required_cache_len(max(map(len, prompts)), 30, 6)
            runner = make_runner("lean", target, max_batch_size=2, max_seq_len=S)
            rows = [RowState() for _ in prompts]
            config = LoopConfig(slots=6, sampling=SamplingParams(), max_seq_len=S, adaptive=ctrl,
                                greedy_chains=runner.capabilities.greedy_chain)
            for _ in decode(runner, NgramDrafter(6), prompts, torch.zeros(2, dtype=torch.int64),
                            StopCriteria(max_new_tokens=30), config, rows=rows):
                pass
        assert [r.tokens for r in rows] == refs


class AlwaysOff(AdaptiveK):
    """Speculation off for every row at every step (the loop then runs plain chain segments)."""

    def plan(self, active, remaining=None, prefill=0, context=None):
        self._last_plan = [0] * len(active)
        return list(self._last_plan)


def run_decode(target_model, drafter, prompts, controller, max_new_tokens, eos=()):
    """decode() as generate() runs it, on the lean runner: (rows, stats)."""
    from specdec_ext.decode import LoopConfig, decode
    from specdec_ext.plan import required_cache_len
    from specdec_ext.runners import make_runner
    from specdec_ext.sampling import SamplingParams
    from specdec_ext.stats import GenerationStats
    from specdec_ext.stops import RowState, StopCriteria
    B, k = len(prompts), controller.k_max
    S = required_cache_len(max(map(len, prompts)), max_new_tokens, k)
    runner = make_runner("lean", target_model, max_batch_size=B, max_seq_len=S)
    rows, stats = [RowState() for _ in prompts], GenerationStats(k=k, batch_size=B)
    config = LoopConfig(slots=k, sampling=SamplingParams(), max_seq_len=S, adaptive=controller,
                        greedy_chains=runner.capabilities.greedy_chain)
    for _ in decode(runner, drafter, prompts, torch.zeros(B, dtype=torch.int64),
                    StopCriteria(max_new_tokens=max_new_tokens, eos_token_ids=list(eos)), config, rows=rows,
                    stats=stats):
        pass
    return rows, stats


def test_speculation_off_throughout_runs_plain_segments_and_never_prefills_the_drafter(tiny_pair):
    """k="auto" off at every step, where the loop chains: plain segments only, the drafter never
    prefilled (a model drafter's runner never built), and the tokens, finish reasons and step counts of
    plain greedy decoding, with rows ending at an EOS in mid-segment."""
    from specdec_ext import plain_generate
    from specdec_ext.drafters import ModelDrafter
    from specdec_ext.runners import make_runner
    from test_generate_utils import one_thread
    target, draft = tiny_pair
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [3, 3, 3, 3, 3, 3]]
    with one_thread():
        free = plain_generate(prompts, target, max_new_tokens=30, eos_token_id=False)
        eos = free.token_ids[1][4]  # row 1 stops at its 5th token, inside the first segment
        plain = plain_generate(prompts, target, max_new_tokens=30, eos_token_id=eos)
        def fresh():
            return ModelDrafter(draft, lambda **kw: make_runner("lean", draft, **kw), k=6, vocab_size=64)
        run_decode(target, fresh(), prompts, AdaptiveK(6), 4)  # the start-up probes (they need the drafter)
        drafter = fresh()
        rows, stats = run_decode(target, drafter, prompts, AlwaysOff(6), 30, eos=[eos])
    assert [r.tokens for r in rows] == plain.token_ids
    assert [r.finish_reason or "length" for r in rows] == plain.finish_reasons
    assert stats.steps == plain.stats.steps and stats.row_steps == plain.stats.row_steps
    assert stats.adaptive["plain_chain_passes"] == stats.steps and stats.draft_time == 0.0
    assert drafter.runner is None  # never prefilled


@pytest.mark.parametrize("drafter_kind", ["model", "ngram"])
def test_greedy_through_plain_segments_and_steps_mixed_equals_plain_greedy(tiny_pair, drafter_kind):
    """Random per-row budgets and all-zero plans (plain segments: the drafter prefilled late or fed the
    segment's tokens at its next proposal, the n-gram drafter indexing them at once), rows ending at an
    EOS at different steps (frozen rows keep nothing from a segment): plain greedy's tokens."""
    from specdec_ext import plain_generate
    from specdec_ext.drafters import ModelDrafter, NgramDrafter
    from specdec_ext.runners import make_runner
    from test_generate_utils import one_thread
    target, draft = tiny_pair
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [3, 3, 3, 3, 3, 3], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6],
               [(3 * i + 2) % 61 + 1 for i in range(45)]]  # longer than a look's window (decode.LOOK_WINDOW)
    with one_thread():
        free = plain_generate(prompts, target, max_new_tokens=40, eos_token_id=False)
        eos = free.token_ids[2][12]
        plain = plain_generate(prompts, target, max_new_tokens=40, eos_token_id=eos)
        for seed in range(3):
            drafter = (ModelDrafter(draft, lambda **kw: make_runner("lean", draft, **kw), k=6, vocab_size=64)
                       if drafter_kind == "model" else NgramDrafter(6))
            rows, stats = run_decode(target, drafter, prompts, RandomBudgets(6, seed=seed, skip=0.5), 40, eos=[eos])
            assert [r.tokens for r in rows] == plain.token_ids, seed
            assert stats.adaptive["plain_chain_passes"] > 0 and stats.draft_time > 0


def test_host_time_leaves_out_the_time_the_consumer_holds_the_loop():
    from specdec_ext.decode import HostTime
    clock = FakeClock()
    host = HostTime(clock)
    clock.t = 2.0  # the loop's host work after a step, then it yields
    handed = host.hand_over([[1]])
    assert next(handed) == [[1]]
    clock.t = 7.0  # the consumer holds the generator between the yield and the resumption
    assert next(handed, None) is None
    clock.t = 7.5  # plan(), then the next step starts
    assert host.since(clock.t) == pytest.approx(2.5)
    host.end(9.0)
    assert host.since(9.25) == pytest.approx(0.25)
    assert list(HostTime(None).hand_over([[2]])) == [[[2]]]  # (no adaptive k: nothing timed)


def test_default_draft_length_is_auto_except_seeded_sampling_and_captured_graphs():
    from specdec_ext import generate
    from specdec_ext.plan import AUTO_K, FIXED_K, _default_draft_length
    from specdec_ext.sampling import SamplingParams
    assert inspect.signature(generate).parameters["k"].default is None
    greedy, sampled = SamplingParams(), SamplingParams(temperature=1.0)
    assert _default_draft_length("model", greedy, False, "auto", False)[0] == AUTO_K
    assert _default_draft_length("model", greedy, True, "auto", False)[0] == AUTO_K  # greedy: a seed changes nothing
    assert _default_draft_length("model", sampled, False, "auto", False)[0] == AUTO_K  # unseeded sampling
    assert _default_draft_length("model", sampled, True, "auto", False)[0] == FIXED_K  # a seed reproduces its sample
    assert _default_draft_length("ngram", sampled, True, "auto", False)[0] == FIXED_K
    # where CUDA graphs capture the steps of a draft model, a fixed k keeps them
    assert _default_draft_length("model", greedy, False, "auto", True)[0] == FIXED_K
    assert _default_draft_length("model", greedy, False, "paged", True)[0] == FIXED_K
    assert _default_draft_length("model", greedy, False, "recompute", True)[0] == AUTO_K  # never captured
    assert _default_draft_length("ngram", greedy, False, "auto", True)[0] == AUTO_K  # lookup proposes on the host


def test_generate_by_default_adapts_k_and_keeps_seeded_samples_reproducible(tiny_pair):
    from specdec_ext import generate
    from specdec_ext.plan import FIXED_K
    from test_generate_utils import hf_greedy, one_thread
    target, draft = tiny_pair
    prompt = [1, 2, 3, 4, 5]
    with one_thread():
        greedy = generate([prompt], target, draft, max_new_tokens=24, eos_token_id=False)
        assert greedy.token_ids[0] == hf_greedy(target, prompt, 24)
        assert greedy.stats.adaptive is not None  # k="auto"
        lookup = generate([prompt], target, "ngram", max_new_tokens=24, eos_token_id=False)
        assert lookup.token_ids == greedy.token_ids and lookup.stats.adaptive is not None
        seeded = [generate([prompt], target, draft, max_new_tokens=24, eos_token_id=False, temperature=1.0, seed=5)
                  for _ in range(2)]
        assert seeded[0].stats.adaptive is None and seeded[0].stats.k == FIXED_K
        assert seeded[0].token_ids == seeded[1].token_ids
        unseeded = generate([prompt], target, draft, max_new_tokens=8, eos_token_id=False, temperature=1.0)
        assert unseeded.stats.adaptive is not None


def test_sampling_through_ragged_budgets_and_skipped_steps_follows_the_target():
    """T = 1 with random per-row budgets and whole skipped steps: the first three tokens follow plain
    target sampling (chi-square); the classic residual bug fails the same threshold over twice the samples
    (fewer drafted positions than test_generate_sampling's k=2, so less power than its 1e-8 negative control:
    over the same 3000 samples its p-value was 1.2e-4 with one layout of the draws)."""
    import test_generate_sampling as tgs
    from specdec_ext import generate
    from specdec_ext.step import lossless_verify
    from test_generate_utils import one_thread, tiny_model
    target = tiny_model("llama", vocab=tgs.TINY_VOCAB, hidden=32, layers=1, seed=3, logit_scale=3.0)
    draft = tiny_model("llama", vocab=tgs.TINY_VOCAB, hidden=32, layers=1, seed=4, logit_scale=3.0)
    joint = tgs.exact_joint(target, tgs.PROMPT, 1.0, 1.0)

    def sample(verifier, samples=tgs.SAMPLES):
        return generate([tgs.PROMPT] * samples, target, draft, max_new_tokens=tgs.POSITIONS,
                        k=RandomBudgets(3, seed=11, skip=0.5, low=1), seed=list(range(samples)), temperature=1.0,
                        verifier=verifier, cost_probe=False)

    with one_thread():
        out = sample(lossless_verify)
        assert all(len(t) == tgs.POSITIONS for t in out.token_ids)
        assert 0.05 < out.stats.acceptance_rate < 0.95
        assert out.stats.adaptive["steps_by_width"].get(1, 0) > 0  # a skipped step (the drafter re-fed after it)
        assert out.stats.adaptive["plain_chain_passes"] == 0  # sampled rows: one-token steps, no chains
        assert tgs.chi_square_p(out.token_ids, joint) > tgs.PASS_P
        broken = sample(tgs.residual_from_p_verifier, 2 * tgs.SAMPLES)
        assert tgs.chi_square_p(broken.token_ids, joint) < tgs.PASS_P  # (seeded: deterministic)


# ------------------------------------------------------------------------------------ greedy looks
def one_row_meta(tokens, slots=4, max_seq_len=96):
    """Metadata of one row whose committed tokens are ``tokens`` (the last one pending)."""
    from specdec_ext.metadata import SpecDecodeMetadata
    from specdec_ext.sampling import SamplingParams
    meta = SpecDecodeMetadata.allocate(batch_size=1, slots=slots, max_seq_len=max_seq_len, sampling=SamplingParams(),
                                       seeds=torch.zeros(1, dtype=torch.int64))
    meta.token_buffer[0, : len(tokens)] = torch.tensor(tokens)
    meta.seq_lens[0] = len(tokens)
    meta.target_input[0, 0] = tokens[-1]
    return meta


def test_a_greedy_look_reads_what_a_first_draft_from_each_position_would_propose(tiny_pair):
    """ModelDrafter.look after a windowed prefill and skipped steps: for each of the last ``shown`` fed
    positions p of each row (rows of different lengths and counts in one pass), whether the draft's greedy
    token after p equals token p + 1 is what a drafter prefilled with the same context (the window's start
    .. p - 1, p pending) proposes first; afterwards the draft cache holds every committed token but the
    pending one, and its next proposal is a drafter's prefilled with all of them."""
    from specdec_ext.drafters import ModelDrafter
    from specdec_ext.metadata import SpecDecodeMetadata
    from specdec_ext.runners import make_runner
    from specdec_ext.sampling import SamplingParams
    _, draft_model = tiny_pair
    factory = lambda **kw: make_runner("lean", draft_model, **kw)  # noqa: E731
    from specdec_ext import plain_generate
    from test_generate_utils import one_thread
    starts = [[(7 * i + 3) % 60 + 1 for i in range(30)], [(11 * i + 5) % 60 + 1 for i in range(25)]]
    with one_thread():  # the draft's own greedy continuations, one token changed: matches and mismatches
        rows = [s + t for s, t in zip(starts, plain_generate(starts, draft_model, max_new_tokens=12,
                                                             eos_token_id=False).token_ids)]
    rows[0][-4] = rows[0][-4] % 60 + 1
    rows[1][-2] = rows[1][-2] % 60 + 1
    shown, window, fed_at_prefill = [8, 5], 12, [30, 25]  # the rest arrives in skipped steps
    meta = SpecDecodeMetadata.allocate(batch_size=2, slots=4, max_seq_len=96, sampling=SamplingParams(),
                                       seeds=torch.zeros(2, dtype=torch.int64))
    for b, tokens in enumerate(rows):
        meta.token_buffer[b, : fed_at_prefill[b] + 1] = torch.tensor(tokens[: fed_at_prefill[b] + 1])
        meta.seq_lens[b] = fed_at_prefill[b] + 1
    drafter = ModelDrafter(draft_model, factory, k=4, vocab_size=64)
    drafter.prefill_window([t[: n] for t, n in zip(rows, fed_at_prefill)], meta, window)
    drafter.skip(meta)
    for b, tokens in enumerate(rows):
        meta.token_buffer[b, : len(tokens)] = torch.tensor(tokens)
        meta.seq_lens[b] = len(tokens)
    matches = drafter.look(meta, shown)
    assert [len(m) for m in matches] == shown
    assert drafter.runner.lengths.tolist() == [len(t) - 1 - (n - window) for t, n in zip(rows, fed_at_prefill)]
    for b, tokens in enumerate(rows):
        start = fed_at_prefill[b] - window  # the window's first committed position
        for j, p in enumerate(range(len(tokens) - 1 - shown[b], len(tokens) - 1)):
            reference = ModelDrafter(draft_model, factory, k=1, vocab_size=64)
            context = one_row_meta(tokens[start: p + 1])
            reference.prefill([tokens[start: p]], context)
            first = reference.propose(context, [1]).token_ids[0, 0].item()
            assert matches[b][j] == (first == tokens[p + 1]), (b, p)
    seen = sum(matches, [])
    assert any(seen) and not all(seen), matches
    whole = ModelDrafter(draft_model, factory, k=4, vocab_size=64)
    single = one_row_meta(rows[0][fed_at_prefill[0] - window:])
    whole.prefill([rows[0][fed_at_prefill[0] - window: -1]], single)
    assert torch.equal(drafter.propose(meta).token_ids[0], whole.propose(single).token_ids[0])


def test_a_look_replays_the_steps_a_drafting_loop_would_have_made_from_each_phase():
    """observe_look: a chain from position j is accepted up to the first mismatch (run r from j accepts 1..r
    and reaches 1..r+1; a run that reaches the look's end reaches and accepts the n - j positions seen; capped
    at k_max), and the look replays the steps a loop drafting k_max would make (the next step from j + accepted
    + 1) from each starting phase p = 0..k_max, weighing n / ((n - p) x phases); other rows untouched."""
    c = AdaptiveK(3, forgetting=1.0, explore_every=0)
    c.reset(2)
    c.reached[:] = 0.0
    c.accepted[:] = 0.0
    c.observe_look([[True, True, False, True, True, True, True], [True, False]], [True, False])
    # runs from j = 0..6: 2, 1, 0, 4 (to the end), 3, 2, 1. Phases 0, 1, 2 step from p, then from 3 (its 3
    # drafts accepted: past the end); phase 3 from 3 alone. n = 7, 4 phases
    weight = {p: 7 / ((7 - p) * 4) for p in range(4)}
    starts = {0: weight[0], 1: weight[1], 2: weight[2], 3: sum(weight.values())}
    reached = {0: 3, 1: 2, 2: 1, 3: 3}
    accepted = {0: 2, 1: 1, 2: 0, 3: 3}
    for i in range(3):
        assert c.reached[0, i] == pytest.approx(sum(w for j, w in starts.items() if reached[j] > i))
        assert c.accepted[0, i] == pytest.approx(sum(w for j, w in starts.items() if accepted[j] > i))
    assert not c.reached[1].any() and not c.accepted[1].any()
    assert c._looked and not c.look_due and c.looks_observed == 1
    c.reached[:] = 0.0
    c.accepted[:] = 0.0
    c.observe_look([[False] * 16], [True])  # no match: 16 steps accepting nothing, whatever the phase
    assert c.reached[0, 0] == pytest.approx(16) and c.accepted[0].sum() == 0 and c.reached[0, 1:].sum() == 0


def test_a_look_weighs_an_agreeing_stretch_as_the_steps_over_it_would():
    """One agreeing stretch of 8 among 16 positions, k_max 4: counting a chain from every position read half
    the first drafts accepted (8 of 16 positions) and position 2 reached 7 times, once per start inside the
    stretch; a drafting loop crosses the stretch in two steps and spends one step per mismatch, so its first
    drafts are accepted in about 2 steps of 10 and its deep positions are reached about twice."""
    c = AdaptiveK(4, forgetting=1.0, explore_every=0)
    c.reset(1)
    c.reached[:] = 0.0
    c.accepted[:] = 0.0
    c.observe_look([[False] * 4 + [True] * 8 + [False] * 4], [True])
    assert 0.2 < c.accepted[0, 0] / c.reached[0, 0] < 0.35
    assert 1.5 < c.reached[0, 1] < 3.0 and c.reached[0, 0] == pytest.approx(c.reached[0].max())


def test_switching_on_again_waits_for_a_look_and_follows_what_it_saw():
    """With looks (greedy rows over a drafter that can), speculation that is off after plain segments
    switches on only after a look: the plan that would switch on asks for one (no drafts, look_due), and
    the plan after it switches on where the look saw the drafts accepted and stays off where it did not;
    a look also stands in for the scheduled explorations (no drafts while off)."""
    for seen, expect_on in ((True, True), (False, False)):
        c = known([[0.95] * 8], flat, 0.05 * V1, plain=V1)
        c.reached[:], c.accepted[:] = 2.0, 2.0 * 0.95  # (few observations: a look's count)
        c.looks, c.plain_chain, c.explore_every = True, 8, 16
        c.observe_plain(8, 8 * V1, [True])  # a plain segment ran: switching on needs a look
        assert c.plan([True], remaining=200) == [0] and c.look_due
        c.observe_plain(8, 8 * V1, [True])
        c.observe_look([[seen] * 16], [True])
        plan = c.plan([True], remaining=200)
        assert (max(plan) > 0) == expect_on and not c.look_due
    off = known([[0.1] * 8], steep, 0.5 * V1, plain=0.9 * V1)
    off.looks, off.plain_chain, off.explore_every = True, 8, 16
    plans = []
    for _ in range(12):
        plans.append(off.plan([True], remaining=500))
        off.observe_plain(8, 8 * 0.9 * V1, [True])
        if off.look_due:
            off.observe_look([[False] * 16], [True])
    assert all(p == [0] for p in plans) and off.looks_observed >= 2


def test_while_off_between_looks_the_plan_is_repeated_without_recomputing_the_costs():
    """Where looks precede every switch on, an off plan is repeated after the first plain segment until a
    look is due (no replan: nothing that sets the choice moves between looks, and a replan's host time is
    paid between model passes); the look's plan and the one after it are computed afresh."""
    off = known([[0.1] * 8], steep, 0.5 * V1, plain=0.9 * V1)
    off.looks, off.plain_chain, off.explore_every = True, 8, 16
    fits = []
    step_times = off.step_times
    off.step_times = lambda *a, **k: fits.append(1) or step_times(*a, **k)  # noqa: E731
    recomputed, after_look = [], False
    for call in range(30):
        before = len(fits)
        assert off.plan([True], remaining=1000) == [0]
        # (a replan refreshes the costs: they are older than COST_REFRESH_STEPS passes here)
        recomputed.append((call, len(fits) > before, off.look_due, after_look))
        off.observe_plain(8, 8 * 0.9 * V1, [True])
        after_look = off.look_due
        if off.look_due:
            off.observe_look([[False] * 16], [True])
    assert sum(1 for *_, due, _ in recomputed if due) >= 3
    # computed at the generation's first plan, at a plan that asks for a look and the plan after a look only
    assert all(call == 0 or due or looked for call, fitted, due, looked in recomputed if fitted)
    assert sum(1 for _, fitted, _, _ in recomputed if fitted) < len(recomputed) / 2
    # without looks the off plan is recomputed every OFF_REPLAN_CALLS calls
    blind = known([[0.1] * 8], steep, 0.5 * V1, plain=0.9 * V1)
    blind.plain_chain, blind.explore_every = 8, 0
    recomputed = []
    step_times_blind = blind.step_times
    blind.step_times = lambda *a, **k: recomputed.append(1) or step_times_blind(*a, **k)  # noqa: E731
    for _ in range(4 * ad.OFF_REPLAN_CALLS):
        assert blind.plan([True], remaining=1000) == [0]
        blind.observe_plain(8, 8 * 0.9 * V1, [True])
    assert len(recomputed) == 4


def test_the_draft_probe_is_shifted_by_what_the_loop_s_draft_steps_cost_beyond_it():
    """A probed draft step is rolled back and feeds nothing, while the loop's steps also feed the tokens
    the last step committed: the probe gives the line's shape and the observed steps its level (as V's
    probe is shifted by the observed - probed offset). Without the shift the weighted line through the
    probe and the one count the loop runs put that count's cost 15-25% low (measured on forced AVX2)."""
    d = AdaptiveK(8)
    d.reset(1)
    probe = lambda s: 0.1 * V1 + 0.1 * V1 * s  # noqa: E731
    extra = 0.15 * V1  # what a loop step costs beyond the probe
    d.record_probes({}, {s: probe(s) for s in (1, 2, 3, 8)})
    for _ in range(40):
        d.observe([4], StepOutcome.of([0], [4], [True]), draft_time=probe(4) + extra, verify_time=0.0,
                  drafted=4, width=0)
    assert d.draft_probe_offset == pytest.approx(extra, rel=1e-3)
    assert d.draft_times()[1:] == pytest.approx([probe(s) + extra for s in range(1, 9)], rel=1e-3)
    # the next generation of this drafter starts from the shift
    d._memory = ad.DrafterMemory()
    d._memory.draft_probe = d.draft_probe.copy()
    d.finish()
    assert d._memory.draft_probe_offset == pytest.approx(extra, rel=1e-3)


def test_the_opening_bet_is_made_at_a_lower_bound_of_the_pooled_acceptance():
    """A generation's first plan bets on the acceptance pooled over earlier generations, at that acceptance
    less OPENING_DOUBT x how far their prompts strayed from the pool (a lower bound): after prompts of one
    acceptance it bets as the pool says; after prompts that alternate between low and high acceptance the
    same pooled mean bets short or not at all. Later plans use the rows' own counts."""
    def after(acceptances):
        table = {}
        c = None
        for a in acceptances:  # finished generations of one drafter: each leaves its acceptance to the pool
            c = AdaptiveK(8, explore_every=0)
            c._memory = table.setdefault("memory", ad.DrafterMemory())
            c.reset(1)
            if c._memory.acceptance is not None:
                c.set_prior(c._memory.acceptance)
            if c._memory.spread is not None:
                c.prior_spread = math.sqrt(c._memory.spread)
            c.reached[:] = 1e6
            c.accepted[:] = a * 1e6
            c._drafted_steps = 10
            c.row_steps = 10
            c.finish()
        nxt = known([[0.0] * 8], steep, 0.05 * V1, plain=1.4 * V1)
        nxt._memory = table["memory"]
        nxt.set_prior(nxt._memory.acceptance)
        nxt.prior_spread = math.sqrt(nxt._memory.spread)
        return nxt

    alike = after([0.8] * 8)
    mixed = after([0.6, 1.0] * 4)
    assert alike._memory.acceptance[0] == pytest.approx(mixed._memory.acceptance[0], abs=0.06)
    assert alike.prior_spread < 0.02 < 0.15 < mixed.prior_spread
    assert alike.opening and mixed.opening
    k_alike, k_mixed = alike.plan([True], remaining=500)[0], mixed.plan([True], remaining=500)[0]
    assert k_alike >= 2 and k_mixed < k_alike
    # without the doubt both bet alike
    mixed_blind = after([0.6, 1.0] * 4)
    mixed_blind.prior_spread = 0.0
    assert mixed_blind.plan([True], remaining=500)[0] >= k_alike - 1
    # once the rows have drafted a step of their own, their counts choose
    mixed._drafted_steps = 1
    assert not mixed.opening


def test_greedy_k_auto_with_looks_equals_plain_greedy(tiny_pair):
    """Through decode with k="auto"'s controller and the model drafter, greedy rows of different prompt
    lengths: looks run (after plain segments), the tokens are plain greedy's, and the drafter's agreement
    the looks read is the controller's data (its counts moved)."""
    from specdec_ext import plain_generate
    from specdec_ext.drafters import ModelDrafter
    from specdec_ext.runners import make_runner
    from test_generate_utils import one_thread
    target, draft = tiny_pair
    prompts = [[(5 * i + 1) % 63 + 1 for i in range(45)], [9, 8, 7] * 4]
    with one_thread():
        plain = plain_generate(prompts, target, max_new_tokens=60, eos_token_id=False)
        controller = AdaptiveK(4, explore_every=8, share_costs=False)
        drafter = ModelDrafter(draft, lambda **kw: make_runner("lean", draft, **kw), k=4, vocab_size=64)
        rows, stats = run_decode(target, drafter, prompts, controller, 60)
    assert [r.tokens for r in rows] == plain.token_ids
    assert controller.looks and stats.adaptive["looks"] >= 1
    assert stats.adaptive["plain_chain_passes"] > 0


# ------------------------------------------------------------------------------------ V's knee, cold passes
# V(1..9) of the bundled target on the forced AVX2 path, ms (BENCHMARKS.md, "V's knee"): flat while the
# pass is memory-bound, then rising by the compute per row
AVX2_V = [2.04, 2.17, 2.57, 3.39, 4.00, 4.55, 5.69, 6.04, 6.70]


def test_the_knee_curve_follows_a_pass_that_turns_compute_bound_where_a_line_overstates_the_short_widths():
    at = np.arange(9, dtype=np.float64)
    probed = [0, 1, 2, 3, 8]  # widths 1, 2, 3, 4, k_max + 1 (t - 1)
    y = [AVX2_V[i] for i in probed]
    fit = ad.knee_curve(probed, y, [1.0] * 5, at)
    first, slope = ad.nonneg_line(probed, y, [1.0] * 5)
    line = first + slope * at
    truth = np.array(AVX2_V)
    assert abs(fit[2] - truth[2]) < 0.05 * truth[2] < abs(line[2] - truth[2])  # V(3): where k = 2 pays
    assert np.all(np.abs(fit - truth) < 0.1 * truth)
    assert np.all(np.diff(fit) >= 0) and np.all(np.diff(fit, 2) >= -1e-12)  # nondecreasing, convex


def test_the_knee_curve_is_the_line_where_the_points_lie_on_one_or_cannot_show_a_knee():
    at = np.arange(9, dtype=np.float64)
    x = [0.0, 1.0, 3.0, 8.0]
    y = [2.0 + 0.1 * t for t in x]  # AMX: nearly linear
    assert ad.knee_curve(x, y, [1.0] * 4, at) == pytest.approx(2.0 + 0.1 * at)
    two = ad.knee_curve([0.0, 8.0], [2.0, 6.0], [1.0, 4.0], at)  # two widths: no knee to place
    assert two == pytest.approx(2.0 + 0.5 * at)
    falling = ad.knee_curve([0.0, 1.0, 2.0], [3.0, 2.0, 1.0], [1.0] * 3, at)  # never below a flat mean
    assert falling == pytest.approx(np.full(9, 2.0))


def knee_reference(x, y, w, at):
    """The knee fit by brute force: numpy's least squares for every knee (and the flat-then-rising
    refit), the least weighted error among the fits that bend upwards and the nonnegative line."""
    xs, ys, ws = (np.asarray(v, dtype=np.float64) for v in (x, y, w))
    x0, root = xs.min(), np.sqrt(ws)
    first, slope = ad.nonneg_line(x, y, w)
    fits = [(np.array([first + slope * x0, slope, 0.0]), x0)]
    for knee in np.unique(xs)[1:-1]:
        columns = np.stack([np.ones_like(xs), xs - x0, np.maximum(xs - knee, 0.0)], axis=1)
        coef = np.linalg.lstsq(columns * root[:, None], ys * root, rcond=None)[0]
        if coef[1] < 0.0:
            flat = np.linalg.lstsq(columns[:, [0, 2]] * root[:, None], ys * root, rcond=None)[0]
            coef = np.array([flat[0], 0.0, flat[1]])
        if coef[2] > 0.0:
            fits.append((coef, knee))

    def curve(coef, knee, t):
        return coef[0] + coef[1] * (t - x0) + coef[2] * np.maximum(t - knee, 0.0)

    errors = [float(np.sum(ws * (curve(c, h, xs) - ys) ** 2)) for c, h in fits]
    coef, knee = fits[int(np.argmin(errors))]
    return curve(coef, knee, np.asarray(at, dtype=np.float64))


def test_the_knee_curve_is_the_least_squares_fit_numpy_finds_by_brute_force():
    rng = np.random.default_rng(7)
    at = np.arange(9, dtype=np.float64)
    for _ in range(300):
        count = int(rng.integers(2, 13))
        x = rng.choice(at, size=count)
        y = rng.random(count) * 5 + x * rng.random() * 0.5
        if rng.random() < 0.5:
            y = np.sort(y)  # (rising, as pass times do)
        w = rng.choice([1.0, ad.OBSERVED_WEIGHT], size=count)
        fit = ad.knee_curve(x.tolist(), y.tolist(), w.tolist(), at)
        np.testing.assert_allclose(fit, knee_reference(x, y, w, at), rtol=1e-9, atol=1e-9)


def test_acceptance_by_position_is_the_recursion_of_the_estimate_row_by_row():
    rng = np.random.default_rng(3)
    reached = rng.random((5, 8)) * 10
    accepted = reached * rng.random((5, 8))
    shape = 0.8 + 0.4 * rng.random(8)
    m = ad.DEFAULT_PRIOR_STRENGTH
    out = ad.acceptance_by_position(reached, accepted, shape, m)
    for b in range(5):
        previous = accepted[b, 0] / reached[b, 0]
        assert out[b, 0] == pytest.approx(previous)
        for i in range(1, 8):
            previous = (accepted[b, i] + m * min(1.0, shape[i] * previous)) / (reached[b, i] + m)
            assert out[b, i] == pytest.approx(previous)
    assert ad.acceptance_by_position(np.zeros((0, 8)), np.zeros((0, 8)), shape, m).shape == (0, 8)


def test_the_knee_picks_the_draft_length_that_pays_where_a_line_through_the_same_probe_drafts_too_long():
    """The AVX2 probe of V, a draft step 0.25 V(1) a token, acceptance 0.9: with V as measured, drafting 2
    tokens is best; the knee curve picks 2, the line through the same points (which puts V(2..4) high
    and V(9) low) a longer draft that runs 5% slower."""
    P, draft = 0.93 * AVX2_V[0] * 1e-3, 0.25 * AVX2_V[0] * 1e-3

    def controller():
        c = AdaptiveK(8, explore_every=0)
        c.reset(1)
        c.reached[:] = 1e6
        c.accepted[:] = 0.9e6
        c.record_probes({t: AVX2_V[t - 1] * 1e-3 for t in (1, 2, 3, 4, 9)}, {}, P)
        c.plain_chain = SEGMENT
        c.costs.plain_obs, c.costs.plain_obs_step = P, c.costs.step
        c.draft_per_token = draft
        return c
    expected = expected_tokens_table(np.full((1, 8), 0.9))[0]
    rate = expected / np.r_[P, np.array(AVX2_V[1:]) * 1e-3 + draft * np.arange(1, 9)]  # on the machine
    assert controller().plan([True]) == [int(np.argmax(rate))] == [2]
    line = controller()
    line.verify_times = lambda context=None: np.maximum(  # (the line this replaced)
        np.poly1d(np.polyfit([0, 1, 2, 3, 8], [AVX2_V[i] * 1e-3 for i in (0, 1, 2, 3, 8)], 1))(np.arange(9.0)), 1e-9)
    chosen = line.plan([True])[0]
    assert chosen > 2 and rate[chosen] < 0.95 * rate[2]


def test_the_first_passes_after_the_prefill_are_not_timed_into_the_costs():
    """After ``start`` (the prompts' prefill just ran) the first COLD_PASSES passes run slow: a step or a
    plain segment starting among them leaves V, D and P as they were; the next one is timed."""
    target = torch.nn.Linear(1, 1)
    c = AdaptiveK(4, share_costs=False)
    c.start(1, target, ("model", 9), plain_chain=SEGMENT)
    c.record_probes({t: flat(t) for t in (1, 2, 3, 4, 5)}, {1: 0.1 * V1, 2: 0.2 * V1}, 0.9 * V1)
    before = c.verify_times().copy()
    for _ in range(ad.COLD_PASSES):
        c.observe([2], StepOutcome.of([2], [2], [True]), draft_time=5 * V1, verify_time=9 * V1, drafted=2, width=3)
    assert c.verify_times() == pytest.approx(before) and np.isnan(c.draft_obs[2])
    c.observe([2], StepOutcome.of([2], [2], [True]), draft_time=0.3 * V1, verify_time=1.5 * V1, drafted=2, width=3)
    assert c.costs.obs[3] == pytest.approx(1.5 * V1) and c.draft_obs[2] == pytest.approx(0.3 * V1)
    cold = AdaptiveK(4, share_costs=False)
    cold.start(1, target, ("model", 9), plain_chain=SEGMENT)
    cold.record_probes({}, {}, 0.9 * V1)
    cold.observe_plain(SEGMENT, SEGMENT * 3 * V1, [True])  # the first segment: cold
    assert cold.plain_time() == pytest.approx(0.9 * V1)
    cold.observe_plain(SEGMENT, SEGMENT * 0.8 * V1, [True])
    assert cold.plain_time() == pytest.approx(0.8 * V1)


# ------------------------------------------------------------------------------------ the context a pass reads
BETA = 0.7e-6  # seconds a token of context adds to a pass (measured on forced AVX2, the bundled target)


def test_the_context_slope_is_the_shared_slope_within_each_width_and_needs_a_spread():
    rng = np.random.default_rng(3)
    slope = ad.ContextSlope(4)
    assert slope.beta() == 0.0
    for _ in range(ad.CONTEXT_SPREAD_OBS - 1):  # within one generation: little spread
        slope.add(0, 150.0 + rng.uniform(-8, 8), V1)
    assert slope.beta() == 0.0
    for group, base in ((0, 0.9 * V1), (2, 1.3 * V1), (3, 1.8 * V1)):  # each width its own intercept
        for context in rng.uniform(50, 600, 40):
            slope.add(group, float(context), base + BETA * context + rng.normal(0, 0.01 * V1))
    assert slope.beta() == pytest.approx(BETA, rel=0.15)
    falling = ad.ContextSlope(2)
    for context in np.linspace(50, 600, 30):
        falling.add(0, float(context), V1 - BETA * context)
    assert falling.beta() == 0.0  # never negative


def test_costs_measured_at_one_context_are_compared_at_the_context_of_the_step_planned():
    """P and V observed over long and short contexts, the choice made at one: both are shifted by beta to
    it, so that drafting one token loses at a short context and pays at a long one (the context adds the
    same to a plain pass and to a verify pass, a larger share of the plain one); the same controller
    without contexts compares the last measurements as they are."""
    acceptance, draft = [0.4] * 8, 0.1 * V1

    def truth(width, context):  # width 0: a plain chain pass
        return (0.9 * V1 if width == 0 else steep(width)) + BETA * context

    def observed(with_context):
        c = known([acceptance], steep, draft, plain=0.9 * V1)
        c.costs.probe[:] = np.nan
        for context in np.linspace(100, 600, 60):  # earlier generations, segments and steps, long and short
            at = float(context) if with_context else None
            c.observe_plain(SEGMENT, SEGMENT * truth(0, context), [True], at)
            c.observe([1], StepOutcome.of([1], [0], [True]), draft_time=draft, verify_time=truth(2, context),
                      drafted=1, width=2, context=at)
        c.reached[:], c.accepted[:] = 1e6, np.array(acceptance) * 1e6  # (the steps' own counts left out)
        return c

    c = observed(True)
    assert c.costs.slope.beta() == pytest.approx(BETA, rel=0.05)
    for context in (120.0, 580.0):
        assert c.plain_time(context) == pytest.approx(truth(0, context), rel=0.01)
        assert c.verify_times(context)[1] == pytest.approx(truth(2, context), rel=0.01)

    def rate(c, context, k):
        return expected_tokens_table(c.acceptance())[0][k] / c.step_times(context)[k]

    assert rate(c, 120.0, 1) < rate(c, 120.0, 0) and rate(c, 580.0, 1) > rate(c, 580.0, 0)
    assert c.plan([True], context=120.0) == [0]
    blind = observed(False)  # the last measurements as they are, at whatever context
    assert blind.costs.slope.beta() == 0.0 and blind.plain_time(120.0) > truth(0, 550)


def test_decode_plans_at_the_rows_mean_context(tiny_pair):
    """The loop hands adaptive k each row's committed tokens (prompt and generated), averaged over the
    unfinished rows, at every plan: they start at the prompts' mean and grow by the tokens emitted."""
    class Recording(AdaptiveK):
        def plan(self, active, remaining=None, prefill=0, context=None):
            contexts.append(context)
            return super().plan(active, remaining, prefill, context=context)

    from specdec_ext import generate
    from test_generate_utils import one_thread
    target, draft = tiny_pair
    prompts = [[1, 2, 3, 4, 5] * 4, [9, 8, 7] * 2]
    contexts = []
    with one_thread():
        result = generate(prompts, target, draft, max_new_tokens=24, k=Recording(4), eos_token_id=False)
    assert contexts[0] == pytest.approx((20 + 6) / 2 + 1)  # the prompts and the first token
    assert all(b > a for a, b in zip(contexts, contexts[1:]))
    # (a row that reaches 24 tokens first leaves the mean: which one does depends on k's timed choices)
    assert contexts[-1] < 20 + 24
    assert result.stats.new_tokens == 48


def test_a_collected_draft_models_shared_memory_goes_with_it():
    """The shared memory of a draft model is keyed by its id: a long-lived target kept one entry per draft
    model it ever drafted with, and a new model given a dead one's id took its acceptance and timings."""
    import gc
    import types

    from specdec_ext.adaptive import _SHARED, DrafterMemory, drafter_key

    class Model:  # (weakly referenceable, like an nn.Module)
        pass

    target, model, other = Model(), Model(), Model()
    key, other_key = drafter_key(types.SimpleNamespace(model=model)), drafter_key(types.SimpleNamespace(model=other))
    table = _SHARED.setdefault(target, {})
    table[("drafter", 1, 8, key)] = DrafterMemory()
    table[("drafter", 1, 8, other_key)] = DrafterMemory()
    assert drafter_key(types.SimpleNamespace(model=model)) == key  # (watched once)
    del model
    gc.collect()
    assert list(table) == [("drafter", 1, 8, other_key)]
    del _SHARED[target]
