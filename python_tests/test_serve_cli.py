"""`specdec serve` as a command: a real process on 127.0.0.1 that SIGTERM shuts down gracefully (in-flight
requests aborted with a message, new ones refused, exit status 0), its flags, and the message that names
the install command when the [serve] extra is missing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch

from specdec_ext import cli, models
from serve_utils import MODEL_NAME, free_port, save_tiny_pair, wait_healthy

EXIT_TIMEOUT_S = 30.0
ROW_POSITIONS = 4096  # long rows: the tiny model cannot finish one before the signal lands


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """A tiny pair saved as model directories (the tokenizer next to the target)."""
    return save_tiny_pair(tmp_path_factory.mktemp("pair"), ROW_POSITIONS)


def test_sigterm_aborts_in_flight_requests_with_a_message_and_exits_0(saved_pair):
    target, draft = saved_pair
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "specdec_ext", "serve", "--target", str(target), "--draft", str(draft),
               "--port", str(port), "--model-name", MODEL_NAME, "-k", "3", "--max-rows", "2", "--threads", "1",
               "--shutdown-grace", "0", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(process, url)
        body = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": ROW_POSITIONS - 40, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=EXIT_TIMEOUT_S) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert "shutting down" in error["message"] and error["code"] == "aborted"
        assert process.wait(EXIT_TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = process.stderr.read()
    assert f"'{MODEL_NAME}' on http://127.0.0.1:{port}/v1 (models in float32;" in stderr and "steps eager" in stderr
    with pytest.raises(httpx.ConnectError):  # nothing listens any more
        httpx.get(url + "/health", timeout=2)


def test_serve_without_the_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # an import of it now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve"])
    message = str(exit_info.value)
    assert "needs uvicorn" in message and 'pip install --no-build-isolation ".[serve]"' in message


def test_serve_help_lists_its_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--device", "--host", "--port", "--max-rows", "--max-queue", "--max-seq-len", "--cache-tokens",
                 "--shutdown-grace", "--model-name", "'none'", "--draft-tokenizer", "'eagle'"):
        assert flag in out


def test_serve_dtype_auto_is_the_bundled_pairs_stored_dtype_and_a_targets_own():
    """--dtype auto: bf16 for the bundled pair (the dtype it is stored in), the loaded dtype for a --target;
    an explicit dtype wins; the cast copies the models (the process's cached pair keeps its dtype) and leaves
    an EAGLE-3 head in float32 (its kernels read bf16 copies of float32 master weights)."""
    parse = cli.build_parser().parse_args
    assert cli._serve_dtype(parse(["serve"])) == "bfloat16"
    assert cli._serve_dtype(parse(["serve", "--target", "t", "--draft", "d"])) is None
    assert cli._serve_dtype(parse(["serve", "--target", "t", "--draft", "d", "--dtype", "bfloat16"])) == "bfloat16"
    assert cli._serve_dtype(parse(["serve", "--dtype", "float32"])) == "float32"
    with pytest.raises(SystemExit):
        parse(["serve", "--dtype", "float16"])
    pair = models.load_models(draft="eagle")
    cast = cli._in_dtype(pair, "bfloat16")
    assert next(cast.target.parameters()).dtype == torch.bfloat16 and cast.target is not pair.target
    assert next(pair.target.parameters()).dtype == torch.float32
    assert cast.draft is pair.draft and next(cast.draft.parameters()).dtype == torch.float32
    plain = cli._in_dtype(models.load_models(), "bfloat16")
    assert next(plain.draft.parameters()).dtype == torch.bfloat16


def test_serve_on_a_device_torch_cannot_use_names_it(capsys):
    """--device: a CUDA device on a machine without one (or a device that does not exist) is a clear exit
    before any model work beyond loading, naming the device."""
    if torch.cuda.is_available():
        asked, expected = f"cuda:{torch.cuda.device_count()}", "CUDA device(s)"
    else:
        asked, expected = "cuda", "CUDA is not available here"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--draft", "none", "--device", asked])
    assert f"specdec serve: device {asked}" in str(exit_info.value) and expected in str(exit_info.value)
    with pytest.raises(SystemExit, match="the models run on cpu or cuda"):
        cli.main(["serve", "--draft", "none", "--device", "meta"])
    with pytest.raises(SystemExit, match="specdec serve: device gpu0: "):
        cli.main(["serve", "--draft", "none", "--device", "gpu0"])
    assert models.default_device() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_run_server_freezes_the_start_up_objects_before_it_serves(monkeypatch):
    """``specdec serve`` moves what start-up made (models, tokenizer, modules) out of the cyclic collector's
    reach before it serves: a full collection over them stalled every running row (~140 ms, measured)."""
    import gc

    from fastapi import FastAPI

    from specdec_ext.serve import server

    frozen = []
    monkeypatch.setattr(server.GracefulServer, "run", lambda self, sockets=None: frozen.append(gc.get_freeze_count()))
    before = gc.get_freeze_count()
    try:
        assert server.run_server(FastAPI(), engine=None, host="127.0.0.1", port=0) == 0
    finally:
        gc.unfreeze()
    assert before == 0 and frozen and frozen[0] > 1000
