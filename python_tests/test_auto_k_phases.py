"""benchmarks/auto_k_phases.py: a k="auto" generation's time, phase by phase, against plain decoding's. Its
instrument charges a call to the outermost timed phase it runs in, and a generator's time (plain decoding's
chains yield) to its phase over every resumption; the script runs end to end on the bundled pair."""
from __future__ import annotations

import collections
import subprocess
import sys
import time
import types
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import auto_k_phases  # noqa: E402


def test_the_instrument_charges_the_outermost_phase_and_a_generator_over_its_resumptions(monkeypatch):
    fake = types.ModuleType("fake_phases")

    def inner():
        time.sleep(0.01)

    def outer():
        inner()
        time.sleep(0.01)

    def chain():
        for _ in range(3):
            time.sleep(0.01)
            yield 1

    fake.inner, fake.outer, fake.chain = inner, outer, chain
    monkeypatch.setitem(sys.modules, "fake_phases", fake)
    monkeypatch.setattr(auto_k_phases, "PHASES", {"a": ("fake_phases", None, ("outer",)),
                                                  "b": ("fake_phases", None, ("inner",)),
                                                  "c": ("fake_phases", None, ("chain",))})
    spent = collections.defaultdict(float)
    auto_k_phases.instrument(spent)
    fake.outer()
    assert spent["a"] >= 0.02 and spent["b"] == 0.0  # (inner ran inside outer: charged there)
    fake.inner()
    assert spent["b"] >= 0.01
    assert list(fake.chain()) == [1, 1, 1] and spent["c"] >= 0.03


def test_the_script_prints_every_phase_for_both_methods():
    out = subprocess.run([sys.executable, "auto_k_phases.py", "--prompt", "code 0", "--repeats", "1"], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    for phase in ("plan", "build", "prefill", "decode", "steps", "looks", "controller", "total"):
        row = next(line for line in lines if line.split()[:1] == [phase])
        plain, auto, difference = map(float, row.split()[1:])
        assert abs(auto - plain - difference) < 0.02
    assert float(next(line for line in lines if line.startswith("total")).split()[1]) > 0
    assert float(next(line for line in lines if line.startswith("decode")).split()[1]) > 0  # plain's chains
    assert "k='auto' / plain in tokens per second" in out.stdout
