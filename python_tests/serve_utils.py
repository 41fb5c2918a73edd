"""Shared builders for the serving tests: a tiny served pair with a chat template, an in-process server on
127.0.0.1 (a free port, stopped by the fixture), and helpers to read streams and metrics.

(No tests here.)
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Dict, Tuple

import httpx
import uvicorn

from specdec_ext.models import Models
from specdec_ext.serve.build import EngineOptions, build_engine, eos_token_ids
from specdec_ext.serve.server import GracefulServer, create_app
from test_generate_utils import CHAR_VOCAB, char_tokenizer, noisy_copy, tiny_model

MODEL_NAME = "tiny-pair"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
SERVER_START_S = 30.0


def tiny_pair(seed: int = 0):
    """(target, draft, tokenizer): a 2-layer Llama over the char vocabulary, a noisy copy as its draft, the
    char tokenizer with a chat template."""
    target = tiny_model("llama", vocab=CHAR_VOCAB, hidden=48, layers=2, logit_scale=4.0, seed=seed)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return target, noisy_copy(target, noise=0.3), tokenizer


def make_app(target, draft, tokenizer, **options):
    """(app, engine) over the pair (``draft`` a model, "ngram" or None for plain decoding)."""
    drafter = "model" if not isinstance(draft, str) and draft is not None else (draft or "none")
    models = Models(target, drafter, draft=draft if drafter == "model" else None, tokenizer=tokenizer)
    engine = build_engine(models, EngineOptions(**options))
    app = create_app(engine, tokenizer, model_name=MODEL_NAME, eos_token_ids=eos_token_ids(target, tokenizer))
    return app, engine


class ServerThread:
    """uvicorn serving ``app`` in a thread on 127.0.0.1 and a free port; ``stop`` shuts it down gracefully
    (the same path as SIGTERM: GracefulServer.shutdown)."""

    def __init__(self, app, engine, grace_s: float = 5.0):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self.server = GracefulServer(config, engine, grace_s)
        self.engine = engine
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def start(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + SERVER_START_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError("the test server did not stop")


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
