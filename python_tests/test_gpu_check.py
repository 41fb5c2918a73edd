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


def test_every_benchmark_script_imports(monkeypatch):
    """Each script under benchmarks/ imports (its module level only: main() is not run), so that a name
    moved inside the package breaks a test here, not a benchmark run (bench_serve.py imported default_device
    from cli.py for a session after it had moved to models.py)."""
    import importlib.util
    import sys

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    broken = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # (dataclasses look their module up there)
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 (every failure is reported by name)
            broken.append(f"{path.name}: {type(error).__name__}: {error}")
    assert not broken, f"benchmark scripts that do not import: {broken}"
