"""audit(): PASS on a correct pair, FAIL with a broken verifier, the break-even report, bad input."""
from __future__ import annotations

import pytest

from specdec_ext import audit
from specdec_ext.audit import two_sample_chi_square, total_variation
from test_generate_sampling import TINY_VOCAB, residual_from_p_verifier
from test_generate_utils import tiny_model

PROMPTS = [[1, 4, 2, 6], [3, 3, 5]]


pytestmark = pytest.mark.usefixtures("single_thread")  # conftest.py: one CPU thread per module


@pytest.fixture(scope="module")
def pair():
    return (tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=3, logit_scale=3.0),
            tiny_model("llama", vocab=TINY_VOCAB, hidden=32, layers=1, seed=4, logit_scale=3.0))


def test_audit_passes_a_correct_pair_and_reports_break_even(pair, capsys):
    target, draft = pair
    report = audit(target, draft, PROMPTS, temperature=0.8, top_p=0.9, positions=3, samples=1500, ks=(1, 2, 3),
                   bench_tokens=12)
    assert report.passed, report.text()
    assert len(report.tests) == 2 * (3 + 1)  # two prompts, three positions and the joint
    assert all(t.samples_spec == t.samples_plain == 1500 for t in report.tests)
    assert all(t.tv < 0.1 for t in report.tests if t.position != "joint")
    assert [r.k for r in report.break_even] == [1, 2, 3]
    for r in report.break_even:
        assert 0 < r.acceptance < 1 and r.draft_cost > 0 and r.verify_cost > 0
        assert 1 <= r.measured_tokens_per_pass <= r.k + 1 and r.measured_speedup > 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out and "break-even" in out and "speedup pred" in out


def test_audit_fails_a_broken_verifier(pair):
    target, draft = pair
    report = audit(target, draft, PROMPTS, temperature=0.8, top_p=0.9, positions=3, samples=1500, run_break_even=False,
                   verbose=False, verifier=residual_from_p_verifier)
    assert not report.passed and report.verdict == "FAIL"
    assert "do NOT follow" in report.text()


def test_statistics_helpers():
    a = [0] * 500 + [1] * 500
    chi2, dof, p, cats = two_sample_chi_square(a, a)
    assert chi2 == 0 and dof == 1 and p == pytest.approx(1.0) and cats == 2
    chi2, dof, p, _ = two_sample_chi_square(a, [0] * 700 + [1] * 300)
    assert p < 1e-10
    assert total_variation(a, [0] * 700 + [1] * 300) == pytest.approx(0.2)


def test_audit_bad_input(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="temperature must be > 0"):
        audit(target, draft, PROMPTS, temperature=0.0)
    with pytest.raises(ValueError, match="positions"):
        audit(target, draft, PROMPTS, temperature=1.0, positions=0)
    with pytest.raises(ValueError, match="prompts"):
        audit(target, draft, None, temperature=1.0)
    # (alpha 1 failed a lossless pair and 0 passed anything; bench_tokens 0 raised ZeroDivisionError)
    for bad, words in ((dict(alpha=1.0), r"alpha must be in \(0, 1\), got 1.0"), (dict(alpha=0.0), "alpha"),
                       (dict(max_prompts=0), "max_prompts and bench_tokens must be >= 1"),
                       (dict(bench_tokens=0), "bench_tokens must be >= 1")):
        with pytest.raises(ValueError, match=words):
            audit(target, draft, PROMPTS, temperature=1.0, **bad)


def test_audit_report_plot(pair, tmp_path, monkeypatch):
    from specdec_ext import plots
    from test_plots import FakeTerminal, png_size

    target, draft = pair
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    report = audit(target, draft, PROMPTS, temperature=1.0, positions=2, samples=100, ks=(1, 2), bench_tokens=6,
                   verbose=False, progress=False)
    assert terminal.getvalue() == ""  # progress=False: no bar even on a terminal
    assert report.pair == plots.pair_label(target, draft)
    path = tmp_path / "audit.png"
    assert report.plot(str(path)) == str(path)
    assert png_size(path) == plots.figure_pixels(1)
