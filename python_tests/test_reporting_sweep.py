"""An outside tester's sweep of the reporting and control surface: ``result.stats`` (GenerationStats),
``result.plan`` (DecodePlan.explain()), adaptive k (``k="auto"``, ``AdaptiveK`` and its knobs,
``stats.adaptive``) and ``specdec_ext.audit``.

Each test states the documented behaviour; the eight defects the sweep found (docstrings: "Was a defect") are
fixed."""
from __future__ import annotations

import json
import math
import re
import sys

import pytest
import torch

import specdec_ext
from specdec_ext import generate, plain_generate
from specdec_ext.adaptive import AdaptiveK, AdaptiveOptions
from specdec_ext.cost_model import expected_tokens_per_pass, predicted_speedup
from specdec_ext.processing import ProcessingState
from specdec_ext.step import lossless_verify
from sampling_stats import prefix_blind
from test_generate_sampling import TINY_VOCAB
from test_generate_utils import CHAR_VOCAB, char_tokenizer, noisy_copy, tiny_model

AUDIT = sys.modules["specdec_ext.audit"]  # (specdec_ext.audit is the function; its module holds the samplers)
PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 33, 34]]
AUDIT_PROMPTS = [[1, 4, 2, 6], [3, 3, 5]]
EOS_IDS = [7, 8, 9, 10, 11, 12, 13]  # ends some rows of PROMPTS early, inside a step or a plain chain
AS_DICT_FIELDS = {"k", "tree", "batch_size", "steps", "new_tokens", "tokens_per_pass", "acceptance_rate",
                  "acceptance_by_position", "prefill_time_s", "draft_time_s", "verify_time_s", "total_time_s",
                  "tokens_per_s", "tpot_s", "target_step_time_s", "draft_cost_c", "verify_cost_v",
                  "predicted_tokens_per_pass", "predicted_speedup", "adaptive"}


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0)
    return target, noisy_copy(target, noise=0.3)


@pytest.fixture(scope="module")
def audit_pair():
    return (tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=3, logit_scale=3.0),
            tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=4, logit_scale=3.0))


def never_drafting(k_max: int = 4) -> AdaptiveK:
    """A controller that expects nothing to be accepted and never explores: it never drafts."""
    return AdaptiveK(k_max, prior_acceptance=0.0, explore_every=0, share_costs=False)


# --------------------------------------------------------------------------------- stats invariants
CONFIGS = {
    "k3": dict(k=3),
    "k1": dict(k=1),
    "k3-paged": dict(k=3, runner="paged"),
    "k2-recompute": dict(k=2, runner="recompute"),
    "k3-seeded-T1": dict(k=3, temperature=1.0, seed=1),
    "k4-T0.7-topk5-topp0.9": dict(k=4, temperature=0.7, top_k=5, top_p=0.9, seed=2),
    "k3-eos": dict(k=3, eos_token_id=EOS_IDS),
    "k4-confidence": dict(k=4, draft_confidence=0.5),
    "ngram-k4": dict(k=4, draft="ngram"),
    "tree-2x3x6": dict(draft_tree=(2, 3, 6)),
    "tree-T1": dict(draft_tree=(2, 2, 4), temperature=1.0, seed=3),
    "auto": dict(k="auto"),
    "auto-eos": dict(k="auto", eos_token_id=EOS_IDS),
    "auto-T1": dict(k="auto", temperature=1.0),
    "adaptivek-3": dict(k=AdaptiveK(3, share_costs=False)),
}


@pytest.mark.parametrize("max_new", [2, 24])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_stats_counts_times_and_reports_agree_with_what_was_returned(pair, name, max_new):
    target, draft = pair
    kw = dict(CONFIGS[name])
    d = kw.pop("draft", draft)
    result = generate(PROMPTS, target, d, max_new_tokens=max_new, **kw)
    s = result.stats
    assert s.batch_size == len(PROMPTS) and s.k == result.plan.slots and s.tree == result.plan.tree
    assert s.new_tokens == sum(map(len, result.token_ids))  # the tokens returned
    assert all(len(t) <= max_new for t in result.token_ids)
    # counts: accepted <= reached, both non-increasing with the position; tokens per pass = accepted + 1
    assert len(s.reached) == len(s.accepted) == s.k
    assert all(0 <= a <= r for a, r in zip(s.accepted, s.reached))
    assert all(s.reached[i + 1] <= s.reached[i] and s.accepted[i + 1] <= s.accepted[i] for i in range(s.k - 1))
    assert s.steps <= s.row_steps <= s.steps * len(PROMPTS)
    assert not s.reached or s.reached[0] <= s.row_steps
    assert s.emitted == s.row_steps + sum(s.accepted)
    if s.row_steps:
        assert 1.0 <= s.tokens_per_pass <= s.k + 1
    for a, acc, reached in zip(s.acceptance_by_position, s.accepted, s.reached):
        assert (math.isnan(a) and reached == 0) or a == pytest.approx(acc / reached)
    assert math.isnan(s.acceptance_rate) or 0.0 <= s.acceptance_rate <= 1.0
    # times: non-negative, the parts inside the total
    for t in (s.prefill_time, s.draft_time, s.verify_time, s.total_time):
        assert t >= 0.0
    assert s.prefill_time + s.draft_time + s.verify_time <= s.total_time + 1e-9
    # reports
    as_dict = s.as_dict()
    assert set(as_dict) >= AS_DICT_FIELDS
    json.dumps(as_dict)
    assert as_dict["new_tokens"] == s.new_tokens and as_dict["steps"] == s.steps
    text = s.summary()
    assert str(s) == text and "inf" not in text.lower() and "None" not in text
    assert f"tokens: {s.new_tokens} " in text and f"target passes: {s.steps}," in text
    assert (s.adaptive is not None) == result.plan.adaptive
    if s.adaptive is None:
        assert "nan" not in text.lower()
    else:  # k_max bounds every step's width
        assert s.adaptive["k_max"] == s.k
        assert all(1 <= width <= s.k + 1 for width in s.adaptive["steps_by_width"])


def test_stats_of_nothing_decoded_are_zero_and_print_dashes(pair):
    target, draft = pair
    for result in (generate(PROMPTS, target, draft, max_new_tokens=0, k=3), plain_generate(PROMPTS, target,
                                                                                               max_new_tokens=0)):
        s = result.stats
        assert result.token_ids == [[]] * len(PROMPTS) and s.new_tokens == 0 and s.steps == 0
        assert math.isnan(s.tokens_per_second) and math.isnan(s.tpot)
        text = s.summary()
        assert "nan" not in text.lower() and "tokens: 0 in" in text and "(- tok/s" in text
        json.dumps(s.as_dict())


@pytest.mark.parametrize("kw", [dict(k=3), dict(k=2, temperature=1.0, seed=5), dict(k=2, stop=["a", "e"]),
                                dict(k=4, stop="  ", eos_token_id=0)], ids=["greedy", "seeded", "stops", "stop+eos"])
def test_a_streamed_call_counts_what_the_same_call_unstreamed_counts(pair, kw):
    target, draft = pair
    tokenizer = char_tokenizer()
    prompts = ["abc", "hello world", "x = 1", "def f("]
    whole = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=20, **kw)
    stream = generate(prompts, target, draft, tokenizer=tokenizer, max_new_tokens=20, stream=True, **kw)
    pieces = list(stream)
    streamed = stream.result
    assert streamed.token_ids == whole.token_ids and streamed.finish_reasons == whole.finish_reasons
    assert "".join(p for p in pieces if p.index == 1) == whole.text[1]
    fields = ("k", "batch_size", "steps", "row_steps", "emitted", "new_tokens", "reached", "accepted")
    assert {f: getattr(streamed.stats, f) for f in fields} == {f: getattr(whole.stats, f) for f in fields}


def test_tree_stats_never_reach_a_position_deeper_than_the_tree(pair):
    """Was a defect, fixed: a tree's row counts num_draft = its node count (N), so a path accepted to the full depth d
    "reaches" position d + 1, which no tree of depth d has, and counts it rejected. The target drafting
    for itself (greedy) accepts everything, yet a (2, 2, 4) tree reports acceptance by position
    [1.0, 1.0, 0.0, -] and a = 0.667 (a k=2 chain of the same draft reports 1.0, 1.0 and a = 1)."""
    target, _ = pair
    chain = generate(PROMPTS, target, target, max_new_tokens=24, k=2).stats
    assert chain.acceptance_rate == 1.0
    for tree in ((2, 2, 4), (3, 1, 3), (2, 3, 6)):
        s = generate(PROMPTS, target, target, max_new_tokens=24, draft_tree=tree).stats
        depth = tree[1]
        assert s.reached[depth:] == [0] * (s.k - depth), (tree, s.reached, s.accepted)
        assert s.acceptance_rate == 1.0, (tree, s.acceptance_by_position)


# --------------------------------------------------------------------------------- plan.explain()
def explain_lines(plan):
    return [(line[: line.index("  ")].strip(), line) for line in plan.explain().splitlines()]


EXPLAIN_CASES = {
    "auto-lean": (dict(), dict(drafter="model", adaptive=True, target_runner="lean", draft_runner="lean")),
    "k3-paged": (dict(k=3, runner="paged"), dict(drafter="model", slots=3, target_runner="paged",
                                                  draft_runner="paged")),
    "k2-recompute": (dict(k=2, runner="recompute"), dict(slots=2, target_runner="recompute")),
    "seeded-T1": (dict(temperature=1.0, seed=0), dict(slots=4, adaptive=False)),
    "tree": (dict(draft_tree=(2, 2, 4)), dict(tree=(2, 2, 4), slots=4, adaptive=False)),
    "ngram": (dict(draft="ngram", k=5), dict(drafter="ngram", slots=5, draft_runner=None)),
    "adaptivek": (dict(k=AdaptiveK(3)), dict(adaptive=True, slots=3)),
    "shrunk": (dict(max_seq_len=24, max_new_tokens=8), dict(adaptive=True, slots=3)),
}


@pytest.mark.parametrize("name", list(EXPLAIN_CASES))
def test_explain_names_what_ran(pair, name):
    target, draft = pair
    kw, expect = EXPLAIN_CASES[name]
    kw = dict(kw)
    d = kw.pop("draft", draft)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [3, 4]]
    result = generate(prompts, target, d, **{"max_new_tokens": 12, **kw})
    plan, stats = result.plan, result.stats
    for field, value in expect.items():
        assert getattr(plan, field) == value, (field, plan)
    lines = dict(explain_lines(plan))
    assert lines["cuda graphs"].split()[2] == "off:" and not plan.cuda_graphs  # the CPU
    assert re.search(rf"\b{plan.target_runner}\b", lines["target runner"])
    assert ("draft runner" in lines) == (plan.draft_runner is not None)
    if plan.draft_runner is not None:
        assert re.search(rf"\b{plan.draft_runner}\b", lines["draft runner"])
    assert f"{plan.max_seq_len} positions per row" in lines["cache"]
    assert f"{len(prompts)} rows" in lines["batch"]
    assert stats.k == plan.slots and stats.tree == plan.tree and (stats.adaptive is not None) == plan.adaptive
    drafter = lines["drafter"]
    if plan.tree is not None:
        assert f"{plan.tree}" in drafter and f"{plan.slots} nodes" in drafter
    elif plan.adaptive:
        assert "k=auto" in drafter and stats.adaptive["k_max"] == plan.slots
    else:
        assert f"k={plan.slots}" in drafter or f"at most {plan.slots}" in lines.get("draft length", "")
    sampling = lines["sampling"]
    assert ("greedy" in sampling) == plan.sampling.greedy


def test_explain_names_one_drafter_when_the_cache_leaves_no_room_for_drafts(pair):
    """Was a defect, fixed: where the cache leaves no room for drafts, k=None falls back to plain decoding, and explain()
    prints two contradictory "drafter" lines: "model chain, k=auto (adaptive, up to 8 per step)" and then
    "none: ... plain decoding". Only the second ran (plan.drafter == "none", no draft runner)."""
    target, draft = pair
    result = generate([list(range(5, 15))], target, draft, max_new_tokens=8, max_seq_len=19)
    assert result.plan.drafter == "none" and result.plan.slots == 0
    drafter_lines = [line for choice, line in explain_lines(result.plan) if choice == "drafter"]
    assert len(drafter_lines) == 1 and "none" in drafter_lines[0], drafter_lines


def test_explains_cache_line_adds_up_to_the_positions_it_states(pair):
    """Was a defect (minor), fixed: with max_new_tokens=0, plain decoding's cache line reads "10 positions per row (longest
    prompt 10 + 0 new - 1: the last is never fed)": 10 + 0 - 1 is 9, not 10."""
    target, draft = pair
    prompt = [list(range(5, 15))]
    for result in (plain_generate(prompt, target, max_new_tokens=0), plain_generate(prompt, target, max_new_tokens=5),
                   generate(prompt, target, draft, max_new_tokens=0, k=3)):
        line = dict(explain_lines(result.plan))["cache"]
        if line.endswith(", no new token)"):  # (plain decoding of nothing: the prompt alone)
            assert re.fullmatch(r"cache\s+10 positions per row \(longest prompt 10, no new token\)", line), line
            assert result.plan.max_seq_len == 10
            continue
        numbers = re.match(r"cache\s+(\d+) positions per row \(longest prompt (\d+) \+ (\d+) new (- 1|\+ 2 x (\d+))",
                           line)
        total, longest, new = (int(numbers.group(i)) for i in (1, 2, 3))
        slots = int(numbers.group(5)) if numbers.group(5) else None
        stated = longest + new - 1 if slots is None else longest + new + 2 * slots
        assert total == result.plan.max_seq_len
        assert stated == total, line


# --------------------------------------------------------------------------------- adaptive k
def test_k_max_bounds_every_step_of_a_controller_that_drafts(pair):
    target, _ = pair
    for T in (0.0, 1.0):
        s = generate(PROMPTS, target, target, max_new_tokens=24, temperature=T,
                     k=AdaptiveK(2, prior_acceptance=1.0, share_costs=False)).stats
        assert s.k == 2 and len(s.reached) == 2 and s.adaptive["k_max"] == 2
        assert set(s.adaptive["steps_by_width"]) <= {1, 2, 3}
        assert len(s.adaptive["acceptance_by_position"]) == 2
        assert s.tokens_per_pass <= 3 and 0.0 <= s.adaptive["mean_row_k"] <= 2


@pytest.mark.parametrize("T", [0.0, 1.0])
def test_a_controller_that_expects_nothing_and_never_explores_never_drafts(pair, T):
    target, draft = pair
    result = generate(PROMPTS, target, draft, max_new_tokens=24, temperature=T, k=never_drafting())
    s = result.stats
    assert s.reached == [0, 0, 0, 0] and s.accepted == [0, 0, 0, 0]
    assert s.adaptive["mean_row_k"] == 0.0 and set(s.adaptive["steps_by_width"]) == {1}
    assert s.adaptive["speculation_off_steps"] == s.adaptive["steps_by_width"][1]
    assert s.tokens_per_pass == 1.0 and s.new_tokens == 24 * len(PROMPTS)
    if T == 0.0:  # (greedy: plain chain segments, the drafter never called)
        assert s.draft_time == 0.0 and s.adaptive["plain_chain_passes"] == s.steps
        assert result.token_ids == plain_generate(PROMPTS, target, max_new_tokens=24).token_ids


def test_adaptive_steps_by_width_count_the_target_passes_the_stats_count(pair):
    """Was a defect, fixed: where greedy rows end at an EOS inside a plain chain segment, stats.steps counts the passes
    up to the last row's end ("the passes the step loop would have made"), but stats.adaptive counts every
    pass of the segment: steps_by_width {1: 8} and "speculation off for 8 steps" next to "target passes: 6"
    in the same summary."""
    target, draft = pair
    s = generate(PROMPTS, target, draft, max_new_tokens=24, eos_token_id=EOS_IDS, k=never_drafting()).stats
    assert s.new_tokens < 24 * len(PROMPTS)  # (the EOS ended rows)
    assert sum(s.adaptive["steps_by_width"].values()) == s.steps, (s.adaptive["steps_by_width"], s.steps)
    assert s.adaptive["speculation_off_steps"] == s.steps


def test_adaptive_summary_writes_a_dash_not_nan_where_nothing_was_decoded(pair):
    """Was a defect, fixed: k="auto" (the default) with max_new_tokens=1: no step runs, and summary() prints "mean k per
    row nan" (the fixed-k summary writes "-" for every unmeasured number: format_measured)."""
    target, draft = pair
    for k in ("auto", None):
        text = generate(PROMPTS, target, draft, max_new_tokens=1, k=k).stats.summary()
        assert "nan" not in text.lower(), text


@pytest.mark.parametrize("knobs, words", [
    (dict(prior_acceptance=-0.1), "prior_acceptance"), (dict(prior_acceptance=1.5), "prior_acceptance"),
    (dict(prior_acceptance=math.nan), "prior_acceptance"), (dict(prior_strength=0.0), "prior_strength"),
    (dict(forgetting=0.0), "forgetting"), (dict(forgetting=1.01), "forgetting"),
    (dict(cost_smoothing=0.0), "cost_smoothing"), (dict(cost_smoothing=math.nan), "cost_smoothing"),
    (dict(explore_every=-1), "explore_every"), (dict(explore_k=-2), "explore_k"),
])
def test_adaptive_options_refuse_documented_bad_values_by_name(knobs, words):
    with pytest.raises(ValueError, match=words):
        AdaptiveK(4, **knobs)
    with pytest.raises(ValueError, match=words):
        AdaptiveOptions(**knobs)


def test_adaptive_k_refuses_a_bad_k_max_and_an_unknown_knob(pair):
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="k_max must be an int >= 1"):
            AdaptiveK(bad)
    with pytest.raises(TypeError):
        AdaptiveK(4, explore_evry=3)
    target, draft = pair
    with pytest.raises(ValueError, match="k .*must be an int >= 1, 'auto' or an AdaptiveK"):
        generate(PROMPTS, target, draft, k="adaptive")


@pytest.mark.parametrize("knobs", [dict(prior_strength=math.inf), dict(prior_draft_cost=math.nan),
                                   dict(prior_draft_cost=-1.0)], ids=["strength-inf", "cost-nan", "cost-negative"])
def test_adaptive_options_refuse_priors_that_break_the_controller(pair, knobs):
    """Was a defect, fixed: AdaptiveOptions is "checked on construction", but a non-finite prior_strength or a NaN or
    negative prior_draft_cost is taken; generate() then fails deep in the controller with "IndexError: list
    index out of range" (prior_strength=inf with any drafter; prior_draft_cost=nan with draft="ngram") or
    runs on a negative draft cost. Expected: ValueError naming the knob at construction."""
    with pytest.raises(ValueError, match=next(iter(knobs))):
        AdaptiveK(4, **knobs)


# --------------------------------------------------------------------------------- audit
def temperature_blind_verifier(meta, proposal, target_logits):
    """A broken verifier: verifies at temperature 1 whatever the rows' temperature."""
    saved = meta.temperature.clone()
    meta.temperature.fill_(1.0)
    try:
        return lossless_verify(meta, proposal, target_logits)
    finally:
        meta.temperature.copy_(saved)


@pytest.mark.parametrize("sampling", [dict(temperature=0.5), dict(temperature=1.0, top_k=3),
                                      dict(temperature=1.3, top_p=0.7), dict(temperature=math.inf)],
                         ids=["T0.5", "topk3", "T1.3-topp0.7", "Tinf"])
def test_audit_passes_the_real_sampler(audit_pair, sampling):
    target, draft = audit_pair
    report = specdec_ext.audit(target, draft, AUDIT_PROMPTS, positions=2, samples=1000, run_break_even=False,
                               verbose=False, **sampling)
    assert report.verdict == "PASS" and report.passed and not report.inconclusive, report.text()
    assert len(report.tests) == 2 * 3 and report.threshold == pytest.approx(report.alpha / 6)
    for t in report.tests:
        assert t.samples_spec == t.samples_plain == 1000 and t.dof == t.categories - 1 >= 0
        assert 0.0 <= t.tv <= 1.0 and 0.0 <= t.p_value <= 1.0


def test_audit_fails_a_verifier_that_ignores_the_temperature(audit_pair):
    target, draft = audit_pair
    report = specdec_ext.audit(target, draft, AUDIT_PROMPTS, temperature=0.5, positions=3, samples=3000,
                               run_break_even=False, verbose=False, verifier=temperature_blind_verifier)
    assert report.verdict == "FAIL" and "do NOT follow" in report.text()
    first = [t for t in report.tests if t.position == "1"]
    assert all(t.p_value > report.threshold for t in first)  # the prefill's token is not the verifier's


def test_audit_is_inconclusive_where_the_target_is_certain(audit_pair, capsys):
    target, draft = audit_pair
    report = specdec_ext.audit(target, draft, AUDIT_PROMPTS, temperature=1.0, top_k=1, positions=2, samples=200,
                               run_break_even=False)
    assert report.verdict == "INCONCLUSIVE" and not report.passed and report.inconclusive
    assert all(t.dof == 0 and t.categories == 1 for t in report.tests)
    assert "verdict: INCONCLUSIVE: nothing was tested" in capsys.readouterr().out


def test_break_even_rows_follow_the_cost_model(audit_pair):
    target, draft = audit_pair
    report = specdec_ext.audit(target, draft, AUDIT_PROMPTS, temperature=1.0, positions=2, samples=200,
                               ks=(1, 2, 4), bench_tokens=10, verbose=False)
    assert [r.k for r in report.break_even] == [1, 2, 4] and report.target_step_time > 0
    for r in report.break_even:
        a, k = r.acceptance, r.k
        assert 0.0 <= a <= 1.0 and r.draft_cost > 0 and r.verify_cost > 0
        assert r.predicted_tokens_per_pass == pytest.approx(k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a))
        assert r.predicted_tokens_per_pass == pytest.approx(expected_tokens_per_pass(a, k))
        assert r.predicted_speedup == pytest.approx(r.predicted_tokens_per_pass / (r.verify_cost + k * r.draft_cost))
        assert r.predicted_speedup == pytest.approx(predicted_speedup(a, k, r.draft_cost, r.verify_cost))
        assert 1.0 <= r.measured_tokens_per_pass <= k + 1 and r.measured_speedup > 0
    rates = [r.acceptance for r in report.break_even]
    assert min(rates) - 1e-12 <= report.acceptance <= max(rates) + 1e-12  # pooled over the rows
    text = report.text()
    best = max(report.break_even, key=lambda r: r.measured_speedup)
    assert f"best measured k = {best.k} ({best.measured_speedup:.2f}x)" in text
    for r in report.break_even:
        assert re.search(rf"^\s+{r.k}\s+{r.acceptance:.3f}\s+{r.draft_cost:.3f}\s+{r.verify_cost:.3f}\s+"
                         rf"{r.predicted_tokens_per_pass:.2f}\s+{r.measured_tokens_per_pass:.2f}", text, re.M)


def test_audit_refuses_bad_prompts_before_any_sampling(audit_pair, monkeypatch):
    target, draft = audit_pair
    calls = []
    monkeypatch.setattr(AUDIT, "speculative_samples", lambda *a, **k: calls.append(1))
    for prompts, words in (([], "prompts is empty"), ([[]], "prompt 0 is empty"), ("abc", "tokenizer")):
        with pytest.raises(ValueError, match=words):
            specdec_ext.audit(target, draft, prompts, temperature=1.0, verbose=False)
    assert calls == []


@pytest.mark.parametrize("bad, words", [
    (dict(ks=(0,)), "ks"), (dict(ks=(2.5,)), "ks"), (dict(ks=()), "ks"),
    (dict(positions=2.5), "positions"), (dict(positions=True), "positions"), (dict(samples=2.5), "samples"),
], ids=["ks0", "ks-float", "ks-empty", "positions-float", "positions-bool", "samples-float"])
def test_audit_refuses_bad_counts_by_name_before_any_sampling(audit_pair, monkeypatch, bad, words):
    """Was a defect, fixed: audit() checks alpha, positions < 1, samples < 2, max_prompts and bench_tokens before any work,
    but not ks nor the counts' types: ks=(0,) is refused only after the whole sampling phase (minutes on a
    real pair), by generate(), naming "k (draft tokens per step)" instead of ks; ks=() runs a break-even
    phase that reports a measured acceptance of 0.0; positions=2.5 or True fails as "max_new_tokens must be
    an int >= 0" and samples=2.5 as "'float' object cannot be interpreted as an integer", after sampling
    has begun."""
    target, draft = audit_pair
    calls = []
    real = AUDIT.speculative_samples
    monkeypatch.setattr(AUDIT, "speculative_samples", lambda *a, **k: calls.append(1) or real(*a, **k))
    with pytest.raises((ValueError, TypeError), match=words):
        specdec_ext.audit(target, draft, AUDIT_PROMPTS, **{"temperature": 1.0, "positions": 2, "samples": 50,
                                                           "ks": (1,), "bench_tokens": 4, "verbose": False, **bad})
    assert calls == [], "refused only after the sampling began"


def test_audit_with_processors_catches_a_prefix_blind_penalty_at_its_default_samples(audit_pair, monkeypatch):
    """Was a defect (power), fixed: docs/architecture.md says audit(processors=...) "checks the kernel and the prefix
    bookkeeping". A prefix-blind verifier (each column penalised with the committed counts only,
    sampling_stats.prefix_blind) under presence/frequency penalties of 2 repeats a token in 13.6% of its
    3-token samples against the target's 1.3%, and audit() at its default samples=1000 says PASS (its per
    position tests cannot see it, and the joint test pools the 512 sequences into categories of >= 10)."""
    target, draft = audit_pair
    processors = dict(presence_penalty=2.0, frequency_penalty=2.0)
    kw = dict(temperature=1.0, positions=3, run_break_even=False, verbose=False, processors=processors,
              max_prompts=1)
    assert specdec_ext.audit(target, draft, AUDIT_PROMPTS, **kw).verdict == "PASS"  # the correct sampler
    monkeypatch.setattr(ProcessingState, "apply", prefix_blind(ProcessingState.apply))
    report = specdec_ext.audit(target, draft, AUDIT_PROMPTS, **kw)  # samples: the default, 1000
    assert report.verdict == "FAIL", report.text()
