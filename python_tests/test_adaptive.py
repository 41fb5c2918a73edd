"""Adaptive k (specdec_ext/adaptive.py): the controller against a brute-force cost model, on simulated
acceptance and simulated costs (no models), then through the decode loop when the loop has the
adaptive hook: greedy output through k="auto" equals the target's greedy output (model and n-gram
drafters, every budget path: per-row budgets, the batch switched off, re-entry after a skip)."""
from __future__ import annotations

import inspect
import random

import numpy as np
import pytest
import torch

from specdec_ext import adaptive as ad
from specdec_ext.adaptive import AdaptiveK, best_batch_cap, best_draft_lengths, expected_tokens_table

V1 = 1e-3  # seconds of a one-token verify step in the simulations


# ------------------------------------------------------------------------------------ helpers
def true_expected(acceptance, k):
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j, by a plain loop."""
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= acceptance[i]
        total += reach
    return total


def brute_force_best(acceptance, verify, c, k_max):
    """argmax_k E(k) / (V(k+1) + k c) by enumeration (ties -> smaller k)."""
    rates = [true_expected(acceptance, k) / (verify(k + 1) + k * c) for k in range(k_max + 1)]
    return int(np.argmax(rates)), rates


class Simulator:
    """Drives a controller with simulated acceptance (per row, per position) and costs."""

    def __init__(self, controller, acceptance, verify, draft_cost, seed=0, noise=0.0):
        self.c = controller
        self.acceptance = [list(a) for a in acceptance]  # [B][k_max] true a_i
        self.verify, self.draft_cost = verify, draft_cost
        self.rng = random.Random(seed)
        self.noise = noise
        self.B = len(acceptance)
        controller.reset(self.B)
        self.drafter_calls = 0

    def _jitter(self, t):
        return t * (1.0 + self.noise * (2 * self.rng.random() - 1))

    def step(self, active=None):
        active = [True] * self.B if active is None else active
        budget = self.c.plan(active)
        K = max(budget)
        accepted = []
        for b in range(self.B):
            n = 0
            while n < budget[b] and self.rng.random() < self.acceptance[b][n]:
                n += 1
            accepted.append(n)
        self.drafter_calls += K > 0
        self.c.observe(budget, budget, accepted, active, draft_time=self._jitter(K * self.draft_cost),
                       verify_time=self._jitter(self.verify(K + 1)), drafted=K, width=K + 1)
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


def test_best_draft_lengths_and_batch_cap_are_the_brute_force_argmax():
    rng = np.random.default_rng(0)
    for _ in range(200):
        B, K = rng.integers(1, 5), rng.integers(1, 9)
        acc = rng.random((B, K))
        times = np.cumsum(rng.random(K + 1) * 0.5) + 0.5
        expected = expected_tokens_table(acc)
        preferred = best_draft_lengths(expected, times)
        for b in range(B):
            rates = [true_expected(acc[b], k) / times[k] for k in range(K + 1)]
            assert rates[preferred[b]] == pytest.approx(max(rates))
        active = rng.random(B) < 0.8
        cap = best_batch_cap(expected, times, preferred, active)
        if not active.any():
            assert cap == 0
            continue
        rates = [sum(true_expected(acc[b], min(preferred[b], K2)) for b in range(B) if active[b]) / times[K2]
                 for K2 in range(int(preferred[active].max()) + 1)]
        assert rates[cap] == pytest.approx(max(rates))


@pytest.mark.parametrize("rows", ["padded", "own"])
def test_controller_picks_the_argmax_of_the_cost_model_for_given_statistics(rows):
    """Set the counts and the costs by hand: plan() is the brute-force argmax per row."""
    k_max = 6
    c = AdaptiveK(k_max, explore_every=0, rows=rows)
    c.reset(3)
    truth = [[0.9, 0.85, 0.8, 0.7, 0.6, 0.5], [0.5] * 6, [0.95, 0.3, 0.3, 0.3, 0.3, 0.3]]
    c.reached[:] = 1e6  # so many observations that the prior does not matter
    c.accepted[:] = np.array(truth) * 1e6
    c.costs.probe[1:] = [flat(t) for t in range(1, k_max + 2)]
    c.draft_per_token = 0.08 * V1
    preferred = []
    for b in range(3):  # a row alone in the batch gets its own argmax
        best, _ = brute_force_best(truth[b], flat, 0.08 * V1, k_max)
        alone = c.plan([i == b for i in range(3)])
        assert alone[b] == best and sum(alone) == best, (b, alone, best)
        preferred.append(best)
    assert preferred[0] > preferred[2] >= 1  # a decaying acceptance is captured (row 2 stops early)
    # together they share one pass of width K + 1: K maximises the batch's tokens per second;
    # padded: every row drafts K (a shorter row saves nothing); own: row b drafts min(k_b, K)
    def time(k):
        return flat(k + 1) + k * 0.08 * V1
    own = preferred if rows == "own" else [k_max] * 3
    rates = [sum(true_expected(truth[b], min(own[b], K)) for b in range(3)) / time(K) for K in range(k_max + 1)]
    cap = int(np.argmax(rates))
    assert c.plan([True] * 3) == [min(p, cap) for p in own]
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
    best0, _ = brute_force_best(truth[0], steep, 0.02 * V1, 8)
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
    """Each row's statistics come from its own outcomes only; rows with different acceptance choose
    different k when the shared pass is cheap."""
    c = controller(rows="own")
    sim = Simulator(c, [[0.95] * 8, [0.35] * 8], flat, 0.1 * V1, seed=1)
    sim.run(300)
    plans = sim.run(40)
    high, low = np.mean([p[0] for p in plans]), np.mean([p[1] for p in plans])
    assert high >= 4 and low <= 2 and high > low + 2
    est = c.acceptance()
    assert abs(est[0, 0] - 0.95) < 0.1 and est[1, 0] < 0.6  # (row 1's estimate is noisy, and frozen while off)
    # padded (the default): one width for the batch, the weak row rides along in the padded pass
    padded = controller()
    sim = Simulator(padded, [[0.95] * 8, [0.35] * 8], flat, 0.1 * V1, seed=1)
    sim.run(300)
    assert all(p[0] == p[1] >= 4 for p in sim.run(40))
    assert abs(padded.acceptance()[1, 0] - 0.35) < 0.25  # still estimated from its own outcomes

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
        solo.observe([d0], [d0], [n0], [True], draft_time=0.0, verify_time=V1, drafted=d0, width=d0 + 1)
        pair.observe([d0, d1], [d0, d1], [n0, n1], [True, True], draft_time=0.0, verify_time=V1,
                     drafted=max(d0, d1), width=max(d0, d1) + 1)
    assert np.allclose(solo.acceptance()[0], pair.acceptance()[0])


def test_exploration_recovers_after_a_regime_change():
    c = controller(explore_every=16, explore_k=2)
    sim = Simulator(c, [[0.0] * 8], flat, 0.05 * V1, seed=2)
    sim.run(200)
    assert sim.run(10) == [[0]] * 10 or max(max(p) for p in sim.run(10)) <= 2
    sim.acceptance = [[0.95] * 8]  # the text became repetitive
    plans = sim.run(80)
    first_on = next(i for i, p in enumerate(plans) if p[0] >= 3)
    assert first_on <= 40, [p[0] for p in plans]
    assert np.mean([p[0] for p in plans[-20:]]) >= 4

    # and back: acceptance collapses -> speculation switches off again
    sim.acceptance = [[0.0] * 8]
    plans = sim.run(60)
    assert sum(p[0] == 0 for p in plans[-20:]) >= 18


def test_noisy_times_still_give_a_near_optimal_rate():
    truth = [0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5]
    c = controller()
    sim = Simulator(c, [truth], flat, 0.15 * V1, noise=0.3, seed=5)
    sim.run(300)
    _, rates = brute_force_best(truth, flat, 0.15 * V1, 8)
    chosen = sim.run(100)
    assert np.mean([rates[p[0]] for p in chosen]) >= 0.95 * max(rates)


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
        self.batch_size, self.k = B, k
        self.token_buffer = torch.arange(B * 16).view(B, 16)
        self.seq_lens = torch.full((B,), 6, dtype=torch.int64)


def test_probe_times_the_widths_and_leaves_the_cache_as_it_was():
    clock = FakeClock()
    runner = FakeRunner(2, clock)
    c = AdaptiveK(4)
    c.reset(2)
    times = c.probe(runner, FakeMeta(2, 4), clock)
    assert sorted(times) == [1, 2, 4, 5]
    for t, s in times.items():
        assert s == pytest.approx(V1 * (1 + 0.5 * (t - 1)))
    verify = c.verify_times()
    assert verify[2] == pytest.approx(V1 * 2.0)  # t = 3 interpolated between 2 and 4
    assert (np.diff(verify) >= 0).all()
    # a steep probe alone switches a high-acceptance batch of rows off before the first step
    c.reached[:] = 1e6
    c.accepted[:] = 0.5e6
    c.draft_per_token = 0.05 * V1
    assert c.plan([True, True]) == [0, 0]


def test_start_probes_once_per_target_and_batch_size_and_later_rows_start_from_the_pooled_acceptance():
    clock = FakeClock()
    runner = FakeRunner(2, clock)
    runner.model = torch.nn.Linear(1, 1)  # the key of the shared state (weakly referenced)
    drafter = type("Drafter", (), {"model": torch.nn.Linear(1, 1)})()
    first = AdaptiveK(4)
    assert sorted(first.start(runner, drafter, FakeMeta(2, 4), clock)) == [1, 2, 4, 5]
    probes = len(runner.widths)
    sim = Simulator(first, [[0.9, 0.9, 0.5, 0.2]] * 2, flat, 0.05 * V1)
    sim.run(100)
    first.finish()
    second = AdaptiveK(4)
    assert second.start(runner, drafter, FakeMeta(2, 4), clock) == {}  # shared: no second probe
    assert len(runner.widths) == probes and second.costs is first.costs
    assert second.draft_per_token == first.draft_per_token
    assert np.allclose(second.acceptance()[0], first.acceptance().mean(axis=0), atol=0.1)
    other = AdaptiveK(4)  # another drafter: the costs are shared, the acceptance prior is not
    other.start(runner, object(), FakeMeta(2, 4), clock)
    assert other.costs is first.costs and other.draft_per_token is None
    assert other.acceptance()[0, 0] == pytest.approx(ad.DEFAULT_PRIOR_ACCEPTANCE)
    unshared = AdaptiveK(4, share_costs=False)
    assert unshared.start(runner, drafter, FakeMeta(2, 4), clock) != {}


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
    for kw in (dict(prior_acceptance=1.5), dict(forgetting=0.0), dict(prior_strength=0.0), dict(cost_smoothing=0),
               dict(rows="ragged")):
        with pytest.raises(ValueError):
            AdaptiveK(4, **kw)
    with pytest.raises(ValueError):
        AdaptiveK(0)


def test_widen_logits_keeps_the_static_buffer():
    meta = FakeMeta(2, 4)
    logits = torch.randn(2, 3, 7)
    out = ad.widen_logits(meta, logits)
    assert out.shape == (2, 5, 7) and torch.equal(out[:, :3], logits)
    again = ad.widen_logits(meta, torch.randn(2, 2, 7))
    assert again.data_ptr() == out.data_ptr()



# ------------------------------------------------------------------------------------ through the loop
class RandomBudgets(AdaptiveK):
    """Every path of the loop: random per-row budgets, all-zero steps (drafter skipped, several in a
    row, then re-entry with a wide catch-up feed)."""

    def __init__(self, k_max, seed=0, skip=0.35, low=0):
        super().__init__(k_max)
        self.rng = random.Random(seed)
        self.skip, self.low = skip, low

    def plan(self, active):
        if self.rng.random() < self.skip:
            return [0] * len(active)
        return [self.rng.randint(self.low, self.k_max) if a else 0 for a in active]


@pytest.fixture(scope="module")
def tiny_pair():
    from test_generate_utils import noisy_copy, tiny_model
    target = tiny_model("llama", vocab=64, hidden=32, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, 0.2)


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
    from specdec_ext.decode import RowState, StopCriteria, decode, required_cache_len
    from specdec_ext.drafters import NgramDrafter
    from specdec_ext.generate import _runner_factory
    from specdec_ext.metadata import SamplingParams
    from test_generate_utils import hf_greedy, one_thread
    target, _ = tiny_pair
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 1, 2, 1, 2, 1]]
    for ctrl in (AdaptiveK(6), RandomBudgets(6, seed=4)):
        with one_thread():
            refs = [hf_greedy(target, p, 30) for p in prompts]
            S = required_cache_len(max(map(len, prompts)), 30, 6)
            runner = _runner_factory("auto")(target, max_batch_size=2, max_seq_len=S)
            rows = [RowState() for _ in prompts]
            for _ in decode(runner, NgramDrafter(6), prompts, k=6, sampling=SamplingParams(),
                            seeds=torch.zeros(2, dtype=torch.int64), stop=StopCriteria(max_new_tokens=30),
                            max_seq_len=S, vocab_size=64, rows=rows, adaptive=ctrl):
                pass
        assert [r.tokens for r in rows] == refs


def test_generate_defaults_to_a_fixed_k_for_reproducible_seeded_sampling():
    from specdec_ext import generate
    assert inspect.signature(generate).parameters["k"].default == 4


def test_sampling_through_ragged_budgets_and_skipped_steps_follows_the_target():
    """T = 1 with random per-row budgets and whole skipped steps: the first three tokens follow plain
    target sampling (chi-square); the classic residual bug fails the same threshold (fewer drafted
    positions than test_generate_sampling's k=2, so less power than its 1e-8 negative control)."""
    import test_generate_sampling as tgs
    from specdec_ext import generate
    from test_generate_utils import one_thread, tiny_model
    target = tiny_model("llama", vocab=tgs.TINY_VOCAB, hidden=32, layers=1, seed=3, logit_scale=3.0)
    draft = tiny_model("llama", vocab=tgs.TINY_VOCAB, hidden=32, layers=1, seed=4, logit_scale=3.0)
    joint = tgs.exact_joint(target, tgs.PROMPT, 1.0, 1.0)

    def sample(verifier):
        return generate([tgs.PROMPT] * tgs.SAMPLES, target, draft, max_new_tokens=tgs.POSITIONS,
                        k=RandomBudgets(3, seed=11, skip=0.5, low=1), seed=list(range(tgs.SAMPLES)), temperature=1.0,
                        verifier=verifier, cost_probe=False)

    with one_thread():
        out = sample(tgs.chain_verifier)
        assert all(len(t) == tgs.POSITIONS for t in out.token_ids)
        assert 0.05 < out.stats.acceptance_rate < 0.95
        assert out.stats.adaptive["steps_by_width"].get(1, 0) > 0  # a skipped step (the drafter re-fed after it)
        assert tgs.chi_square_p(out.token_ids, joint) > tgs.PASS_P
        broken = sample(tgs.residual_from_p_verifier)
        assert tgs.chi_square_p(broken.token_ids, joint) < tgs.PASS_P  # (seeded: deterministic)
