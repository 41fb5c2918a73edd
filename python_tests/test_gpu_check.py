"""benchmarks/gpu_check.sh runs only where a GPU is lent (minutes of device time, rarely), so what it names
is checked here on any machine: every test node it passes to pytest exists, and every benchmark flag it
passes is one that benchmark's parser declares. Nothing is run."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (ROOT / "benchmarks" / "gpu_check.sh").read_text()


def _commands() -> list:
    """The script's commands with their continuation lines joined."""
    return SCRIPT.replace("\\\n", " ").splitlines()


def test_every_test_node_gpu_check_runs_exists():
    nodes = re.findall(r'\$REPO/(python_tests/[\w/]+\.py)(?:::(\w+))?', SCRIPT)
    assert len(nodes) >= 10
    missing = []
    for path, name in nodes:
        source = ROOT / path
        if not source.is_file() or (name and not re.search(rf"^def {name}\(", source.read_text(), re.M)):
            missing.append(f"{path}::{name}" if name else path)
    assert not missing, f"gpu_check.sh names tests that do not exist: {missing}"


def test_every_benchmark_flag_gpu_check_passes_is_declared():
    calls = [re.search(r'\$REPO/(benchmarks/\w+\.py)"?(.*)', line) for line in _commands()]
    calls = [(m.group(1), m.group(2)) for m in calls if m]
    assert {path for path, _ in calls} >= {"benchmarks/bench_tpot.py", "benchmarks/bench_serve.py",
                                           "benchmarks/bench_eagle.py"}
    undeclared = []
    for path, arguments in calls:
        source = (ROOT / path).read_text()
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", arguments):
            if f'"{flag}"' not in source:
                undeclared.append(f"{path} {flag}")
    assert not undeclared, f"gpu_check.sh passes flags its benchmarks do not declare: {undeclared}"
