"""benchmarks/replay_auto_k.py: the real k="auto" controller replayed over recorded draft agreement and a cost
table, without a model pass. Deterministic given its seed, and what it replays holds of the controller: on
a prompt the draft never agrees with, k="auto" loses no more than its looks, its prefills and a few drafting
steps; on one it always agrees with, where drafts are cheap, it speculates nearly throughout."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import replay_auto_k as replay  # noqa: E402

NEW = 96
PROMPT = 150


def _costs(**change) -> replay.Costs:
    """A table shaped like forced AVX2's on the bundled pair (ms)."""
    table = dict(plain=1.7, verify=[float("nan"), 1.9, 2.4, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5, 6.0],
                 draft=[0.0, 0.3, 0.45, 0.6, 0.75, 0.9, 1.0, 1.1, 1.2], host=0.08, segment_host=0.1, look=0.9,
                 window_prefill=1.0, prefill_per_token=0.017, prepare=0.6, context=0.0007, measured_at=200.0)
    table.update(change)
    return replay.Costs(**table)


def _record(label: str, agree: int) -> replay.Agreement:
    steps = [agree] * NEW
    return replay.Agreement(label, "test", PROMPT, NEW, steps, {n: [agree] * min(16, n - 1) for n in range(2, NEW + 1)})


def _spent(records, costs, seed=0):
    return replay.replay_group(records, costs, replays=2, seed=seed, noise=0.02)


def test_a_replay_is_deterministic_given_its_seed():
    records = [_record("hopeless", 0), _record("easy", 1)]
    first, again = _spent(records, _costs()), _spent(records, _costs())
    assert {k: [s.total for s in v] for k, v in first.items()} == {k: [s.total for s in v] for k, v in again.items()}
    other = _spent(records, _costs(), seed=1)
    assert [s.total for s in other["easy"]] != [s.total for s in first["easy"]]


def test_on_a_prompt_the_draft_never_agrees_with_k_auto_pays_its_looks_and_a_few_steps_at_most():
    for spent in _spent([_record("hopeless", 0)], _costs())["hopeless"]:
        assert spent.drafting_steps <= 4  # the opening bet on the prior p0, before its first disagreement
        assert spent.looks_run <= 2  # and looks on the backed-off schedule
        assert spent.steps + spent.looks + spent.prefills < 0.03 * spent.plain
        assert spent.plain / spent.total > 0.95


def test_on_a_prompt_the_draft_always_agrees_with_k_auto_speculates_nearly_throughout():
    for spent in _spent([_record("easy", 1)], _costs())["easy"]:
        assert spent.passes <= 16  # at most the segments before the first look and the drafter's switch on
        assert spent.steps_plain / spent.steps > 2.0 and spent.plain / spent.total > 1.5  # (the steps: k = 8)


def test_costs_free_of_looks_are_what_they_say():
    costs = _costs().free_looks()
    assert (costs.look, costs.window_prefill, costs.prefill_per_token, costs.prepare) == (0.0, 0.0, 0.0, 0.0)
    assert costs.plain == _costs().plain and costs.verify[1:] == _costs().verify[1:]


def test_a_recorded_agreement_round_trips_through_its_json(tmp_path):
    import json
    from dataclasses import asdict

    records = [_record("hopeless", 0), _record("easy", 1)]
    path = tmp_path / "agreement.json"
    path.write_text(json.dumps([asdict(r) for r in records]))
    assert replay.load_agreement(str(path)) == records


@pytest.mark.parametrize("agree", [0, 1])
def test_the_report_prints_a_row_per_prompt_and_counts_those_below_the_goal(agree, capsys):
    below = replay.report([_record("p", agree)], _costs(), replays=1, seeds=1, noise=0.0)
    out = capsys.readouterr().out
    assert out.count("\ntest   p ") == 1 and f"# {below} of 1 prompts below 0.97" in out
    assert below == (1 if agree == 0 else 0)
