"""``specdec serve``: an OpenAI-compatible HTTP server over continuous batching of the speculative loop.

    request.py   GenerationRequest (one request, as the engine sees it), RowEvent (what a step tells it),
                 the rejections (queue full, too large, shutting down)
    budget.py    CacheBudget: what a request needs of the target's cache; admission never overcommits it
    batcher.py   ContinuousBatcher: a fixed number of slots, rows joining (start_rows, decode.join_rows) and leaving
                 (free_rows) between steps, one decode step over the slots in use (step.Stepper.step,
                 the step generate() runs); no threads
    engine.py    Engine: the batcher in its own thread; submit / cancel from any thread, queue limit,
                 graceful shutdown
    build.py     build_engine(models, options): plan.plan_server, then its runners and drafter
    metrics.py   ServeMetrics: counters and histograms in the Prometheus text format
    text.py      TextStream: a request's text in pieces as its tokens arrive (what generate() streams)
    protocol.py  the OpenAI request bodies (pydantic) and response objects
    app.py       the FastAPI app: completions, chat, models, health, metrics; SSE streaming
    server.py    uvicorn: run_server (SIGTERM drains the engine, exit 0) and ServerThread

Only protocol.py, app.py and server.py need the ``serve`` extra (FastAPI, uvicorn); the engine runs
without it.
"""
from __future__ import annotations

import importlib

DEFAULT_MAX_ROWS = 16  # slots: the most rows that decode at once
DEFAULT_MAX_QUEUE = 64  # requests that may wait for a slot before 429
DEFAULT_SHUTDOWN_GRACE_S = 30.0  # what running requests get to finish after SIGTERM

SERVE_MODULES = ("fastapi", "uvicorn")
SERVE_INSTALL_HINT = ('pip install --no-build-isolation ".[serve]" in the specdec_ext checkout (specdec_ext is '
                      'not on a package index), or pip install "fastapi>=0.110" "uvicorn>=0.29"')


class ServeDependencyError(ImportError):
    """FastAPI or uvicorn is missing (the ``serve`` extra)."""


def require_serve_dependencies() -> None:
    """Raise ServeDependencyError naming the install command when the ``serve`` extra is missing."""
    missing = []
    for name in SERVE_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise ServeDependencyError(f"specdec serve needs {' and '.join(missing)} (the [serve] extra): "
                                   f"{SERVE_INSTALL_HINT}")
