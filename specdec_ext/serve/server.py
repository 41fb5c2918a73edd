"""Running the app (serve/app.py) with uvicorn: ``run_server`` (the ``specdec serve`` command) and
``ServerThread`` (a background thread: tests, benchmarks, notebooks).

SIGTERM (or Ctrl-C): uvicorn stops accepting connections, the engine takes no new requests (503),
aborts the queued ones, gives the running ones ``shutdown_grace_s`` to finish and aborts the rest with
a message; then the process exits with status 0.
"""
from __future__ import annotations

import gc
import logging
import signal
import threading
import time

import uvicorn
from fastapi import FastAPI

from . import DEFAULT_SHUTDOWN_GRACE_S
from .engine import Engine

log = logging.getLogger("specdec_ext.serve")


class GracefulServer(uvicorn.Server):
    """uvicorn, whose shutdown (SIGTERM, SIGINT or should_exit) first drains the engine: no new requests,
    the running ones ``grace_s`` seconds to finish (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, engine: Engine, grace_s: float):
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    async def shutdown(self, sockets=None) -> None:
        self.engine.begin_shutdown(self.grace_s)
        await super().shutdown(sockets)


class ServerThread:
    """uvicorn serving ``app`` in a background thread (tests, benchmarks, notebooks): ``start`` binds
    ``host`` on ``port`` (0: a free port, then ``self.port``), ``stop`` shuts down as SIGTERM would
    (GracefulServer.shutdown: the engine drains for ``grace_s``). No signal handlers are installed."""

    def __init__(self, app: FastAPI, engine: Engine, *, host: str = "127.0.0.1", port: int = 0,
                 grace_s: float = DEFAULT_SHUTDOWN_GRACE_S, log_level: str = "warning"):
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=int(grace_s) + 5)
        self.server = GracefulServer(config, engine, grace_s)
        self.engine, self.host, self.port = engine, host, port
        self.thread = threading.Thread(target=self.server.run, name="specdec-uvicorn", daemon=True)

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError("the server did not stop")


def run_server(app: FastAPI, engine: Engine, *, host: str, port: int, shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
               log_level: str = "info") -> int:
    """Serve until SIGTERM / SIGINT; returns 0 after a graceful shutdown."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=int(shutdown_grace_s) + 5)
    server = GracefulServer(config, engine, shutdown_grace_s)
    # uvicorn re-raises the signal it caught once it has shut down; by then the shutdown is done, so the
    # handlers it restores must not kill the process (the exit status is then 0, not 128 + signal)
    previous = {sig: signal.signal(sig, _already_shut_down) for sig in (signal.SIGTERM, signal.SIGINT)}
    freeze_start_up_objects()
    try:
        server.run()
    except SystemExit as failed:  # uvicorn's start-up failure (a port in use: exit status 3 after its log line)
        if server.started:
            raise
        raise SystemExit(f"specdec serve: error: could not listen on {host}:{port} (exit status {failed.code} from "
                         "uvicorn, whose message is above: the port in use?)") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def freeze_start_up_objects() -> int:
    """Move every object alive now (the models, the tokenizer, the imported modules) out of the cyclic
    collector's reach (gc.freeze): a full collection walked them all, ~140 ms of the engine thread's time
    while every running row waited (measured at 16 clients on the bundled pair, once or twice per
    100 requests), which the step costs of the draft length by load also took in. Only for a process
    that is the server (``specdec serve``), never a caller's (ServerThread). Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _already_shut_down(signum, frame) -> None:
    log.info("specdec serve: signal %d after the shutdown: exiting", signum)
