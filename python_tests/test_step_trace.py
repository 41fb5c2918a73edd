"""One step, readable in few files (issue 26): a traced greedy step of generate() on the bundled pair
(sys.setprofile over ``Stepper.step``) crosses at most MAX_STEP_FILES project Python files, and
docs/architecture.md names each of them; generate() and the server's batcher both step through
``Stepper.step``."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import specdec_ext
from specdec_ext import step as step_module

MAX_STEP_FILES = 8
PACKAGE = Path(specdec_ext.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
TRACED_CALL = 3  # a step after the first ones (buffers made, the draft runner built)


def _trace_steps(monkeypatch, run) -> list:
    """The project files (relative to specdec_ext/) each call of Stepper.step crossed while ``run()`` ran."""
    original = step_module.Stepper.step
    crossed = []

    def traced(self, *args, **kwargs):
        files = set()

        def profile(frame, event, arg):
            if event == "call":
                name = frame.f_code.co_filename
                if name.startswith(str(PACKAGE) + os.sep):
                    files.add(os.path.relpath(name, PACKAGE))

        sys.setprofile(profile)
        try:
            return original(self, *args, **kwargs)
        finally:
            sys.setprofile(None)
            crossed.append(files)

    monkeypatch.setattr(step_module.Stepper, "step", traced)
    run()
    return crossed


def test_a_greedy_step_on_the_bundled_pair_crosses_at_most_eight_files(monkeypatch):
    from specdec_ext import generate
    crossed = _trace_steps(monkeypatch, lambda: generate("def fibonacci(n):", max_new_tokens=40, k=4))
    assert len(crossed) >= TRACED_CALL, f"only {len(crossed)} steps ran"
    files = sorted(crossed[TRACED_CALL - 1])
    assert "step.py" in files and any(f.startswith("runners/") for f in files), files
    assert len(files) <= MAX_STEP_FILES, f"a greedy step crossed {len(files)} files: {files}"
    text = ARCHITECTURE.read_text()
    missing = [f for f in files if f"specdec_ext/{f}" not in text]
    assert not missing, f"docs/architecture.md does not name these files of a step: {missing}"


def test_the_server_steps_through_the_same_step_function(monkeypatch):
    """The batcher's step is a Stepper.step over its rows, and gives generate()'s tokens."""
    from serve_utils import tiny_pair
    from specdec_ext import generate
    from specdec_ext.models import Models
    from specdec_ext.serve.build import EngineOptions, build_engine
    from specdec_ext.serve.request import GenerationRequest
    from specdec_ext.sampling import SamplingParams
    from specdec_ext.stops import StopCriteria
    target, draft, tokenizer = tiny_pair()
    engine = build_engine(Models(target, "model", draft=draft, tokenizer=tokenizer),
                          EngineOptions(k=3, max_seq_len=128, max_rows=2))
    prompt = tokenizer("hello world")["input_ids"]
    events = []
    request = GenerationRequest(prompt, SamplingParams(), 0, StopCriteria(20))
    crossed = _trace_steps(monkeypatch, lambda: _serve(engine, request, events.append))
    assert len(crossed) >= 2  # steps after the admission's first token
    served = [t for event in events for t in event.tokens]
    expected = generate([prompt], target, draft, k=3, max_new_tokens=20, eos_token_id=False, seed=0).token_ids[0]
    assert served == expected


def _serve(engine, request, sink) -> None:
    """Admit one request into the engine's batcher and step until it ends (no threads)."""
    batcher = engine.batcher
    batcher.admit([(request, sink, 0.0)])
    while batcher.running:
        batcher.step()
