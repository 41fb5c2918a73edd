"""Shared builders for the serving tests: a tiny served pair with a chat template, the app over it (served
in-process by serve.server.ServerThread on 127.0.0.1 and a free port), and helpers to read metrics.

(No tests here.)
"""
from __future__ import annotations

import contextlib
import queue
import time
from typing import Dict, List, Optional, Tuple

import httpx

from specdec_ext.models import Models
from specdec_ext.serve.build import EngineOptions, build_engine, eos_token_ids
from specdec_ext.serve.app import create_app
from specdec_ext.serve.server import ServerThread
from test_generate_utils import CHAR_VOCAB, char_tokenizer, noisy_copy, tiny_model

MODEL_NAME = "tiny-pair"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def tiny_pair(seed: int = 0):
    """(target, draft, tokenizer): a 2-layer Llama over the char vocabulary, a noisy copy as its draft, the
    char tokenizer with a chat template."""
    target = tiny_model("llama", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0, seed=seed)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return target, noisy_copy(target, noise=0.3), tokenizer


def save_tiny_pair(root, max_positions: int):
    """``tiny_pair``'s models with ``max_positions`` positions saved as model directories under ``root`` (the
    tokenizer, with its chat template, beside the target): (target directory, draft directory)."""
    target = tiny_model("llama", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0, max_positions=max_positions)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    noisy_copy(target, noise=0.3).save_pretrained(root / "draft")
    return root / "target", root / "draft"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server started in a subprocess)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_START_TIMEOUT_S = 120.0  # importing torch and transformers in a fresh process is slow on a shared machine


def wait_healthy(process, url: str, timeout_s: float = SERVER_START_TIMEOUT_S) -> None:
    """Wait until the ``specdec serve`` subprocess ``process`` answers ``url``/health with 200 (AssertionError if it
    exits first, with its stderr, or takes longer than ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"specdec serve exited with {process.returncode}: {process.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("specdec serve did not become healthy")


def make_app(target, draft, tokenizer, **options):
    """(app, engine) over the pair (``draft`` a model, "ngram" or None for plain decoding)."""
    drafter = "model" if not isinstance(draft, str) and draft is not None else (draft or "none")
    models = Models(target, drafter, draft=draft if drafter == "model" else None, tokenizer=tokenizer)
    engine = build_engine(models, EngineOptions(**options))
    app = create_app(engine, tokenizer, model_name=MODEL_NAME, eos_token_ids=eos_token_ids(target, tokenizer))
    return app, engine


__all__ = ["MODEL_NAME", "CHAT_TEMPLATE", "ServerThread", "tiny_pair", "save_tiny_pair", "free_port", "wait_healthy", "make_app", "serve_app", "openai_client", "metrics",
           "wait_until", "slow_target", "Collector", "serve_staggered", "EVENT_TIMEOUT_S"]

EVENT_TIMEOUT_S = 60.0  # the longest a test waits for an engine event


def serve_app(pair, **options):
    """A running server over the pair (a generator for a module fixture: yields it, then stops it)."""
    app, engine = make_app(*pair, **options)
    server = ServerThread(app, engine, grace_s=5.0).start()
    yield server
    server.stop()


def openai_client(server: ServerThread, **kwargs):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60.0, **kwargs)


def metrics(server: ServerThread) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """/metrics parsed: {(name, sorted labels): value} (every line must parse)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, label_text = head.partition("{")
        labels = tuple(sorted(tuple(part.split("=", 1)) for part in label_text.rstrip("}").split(",") if part))
        out[(name, tuple((k, v.strip('"')) for k, v in labels))] = float(value)
    return out


def wait_until(condition, timeout_s: float = 20.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


@contextlib.contextmanager
def slow_target(model, seconds_per_pass: float):
    """Each forward of ``model`` takes at least ``seconds_per_pass`` longer (a hook on its LM head, which the
    lean runner calls too when the head has hooks): requests then stay in flight long enough to be
    cancelled, queued behind or aborted, whatever the machine's speed."""
    handle = model.get_output_embeddings().register_forward_hook(lambda *args: time.sleep(seconds_per_pass))
    try:
        yield model
    finally:
        handle.remove()


class Collector:
    """An engine event sink that keeps a request's tokens and how it ended."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()
        self.tokens: List[int] = []
        self.reason: Optional[str] = None
        self.message: Optional[str] = None

    def __call__(self, event) -> None:
        self.events.put(event)

    def next(self):
        event = self.events.get(timeout=EVENT_TIMEOUT_S)
        self.tokens += event.tokens
        if event.finished:
            self.reason, self.message = event.finish_reason, event.message
        return event

    def wait(self) -> "Collector":
        while self.reason is None:
            self.next()
        return self


def serve_staggered(engine, requests) -> List[List[int]]:
    """Run ``requests`` on ``engine`` (started here, stopped after) so that rows join and leave a running
    batch: the first two at once, the rest once the first has ended. Each request's tokens."""
    sinks = [Collector() for _ in requests]
    engine.start()
    try:
        for request, sink in list(zip(requests, sinks))[:2]:
            engine.submit(request, sink)
        sinks[0].wait()
        for request, sink in list(zip(requests, sinks))[2:]:
            engine.submit(request, sink)
        return [sink.wait().tokens for sink in sinks]
    finally:
        engine.stop()
