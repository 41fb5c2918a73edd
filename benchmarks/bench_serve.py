"""specdec serve under load: N concurrent clients on the bundled pair, speculative against plain decoding.

Each mode starts `specdec serve` in its own process on 127.0.0.1 (speculative: the bundled draft with a
fixed k; plain: the same server with ``--draft none``), sends one warm-up request, then runs N closed-loop
clients (each sends its next request when the previous one ended) for every N in --clients. Requests are
streamed completions of held-out code prompts (the first lines of stdlib files the pair never saw), greedy
by default, ``ignore_eos`` so that every request returns exactly --max-tokens tokens.

Reported per (mode, N): requests/s and output tokens/s over the wall time of the N clients, p50 / p99
time to first token (request sent -> first streamed text), p50 / p99 time per output token (per request:
(last token - first token) / (tokens - 1)), and the server's tokens per target pass (/metrics).

    python benchmarks/bench_serve.py                       # N = 1, 4, 16; 3 requests per client
    python benchmarks/bench_serve.py --clients 1,4 --requests-per-client 2 --max-tokens 32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import List, Optional

import httpx

from specdec_ext.cli import BUNDLED_MODEL_NAME, heldout_prompts

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0


@dataclass
class RequestTiming:
    first_token_s: float  # request sent -> first streamed text
    per_token_s: Optional[float]  # (last - first) / (tokens - 1)
    tokens: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(plain: bool, args) -> tuple:
    """`specdec serve` in a child process; (process, url) once /health answers."""
    port = _free_port()
    command = [sys.executable, "-m", "specdec_ext", "serve", "--port", str(port), "--threads", str(args.threads),
               "--max-rows", str(args.max_rows), "--max-seq-len", str(args.max_seq_len), "--log-level", "warning"]
    command += ["--draft", "none"] if plain else ["-k", str(args.k)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"bench_serve: the server exited with {process.returncode}: {process.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("bench_serve: the server did not become healthy")


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, args) -> RequestTiming:
    body = {"model": BUNDLED_MODEL_NAME, "prompt": prompt, "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            raise SystemExit(f"bench_serve: HTTP {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise SystemExit(f"bench_serve: {chunk['error']['message']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                last = time.perf_counter()
                first = first if first is not None else last
    per_token = (last - first) / (tokens - 1) if tokens > 1 and first is not None else None
    return RequestTiming((first or time.perf_counter()) - start, per_token, tokens)


async def run_clients(url: str, clients: int, prompts: List[str], args) -> tuple:
    """N closed-loop clients; (timings, wall seconds)."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 2)) as client:
        async def client_loop(c: int) -> List[RequestTiming]:
            return [await one_request(client, url, prompts[(c * args.requests_per_client + r) % len(prompts)], args)
                    for r in range(args.requests_per_client)]

        start = time.perf_counter()
        per_client = await asyncio.gather(*(client_loop(c) for c in range(clients)))
        return [t for timings in per_client for t in timings], time.perf_counter() - start


def _percentile(values: List[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def _counters(url: str) -> dict:
    """The server's unlabelled counters (/metrics), by name."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("specdec_") and "{" not in line and line.split()[0].endswith("_total"):
            name, value = line.split()
            out[name] = float(value)
    return out


def _tokens_per_pass(before: dict, after: dict, requests: int) -> float:
    """Tokens per row per target pass over a run: the decoded tokens (each request's first comes from its
    prefill) over the row-passes."""
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)
    passes = delta("specdec_row_target_passes_total")
    return (delta("specdec_generated_tokens_total") - requests) / passes if passes else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,16", help="concurrent clients, comma-separated (default: 1,4,16)")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("-k", "--k", type=int, default=4, dest="k", help="draft tokens per step (default: 4)")
    parser.add_argument("--max-rows", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (default: 1)")
    parser.add_argument("--prompt-lines", type=int, default=20)
    parser.add_argument("--modes", default="speculative,plain")
    args = parser.parse_args(argv)
    clients = [int(x) for x in args.clients.split(",")]
    prompts = [text for _, text in heldout_prompts(8, args.prompt_lines)]
    print(f"# {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, python {platform.python_version()};"
          f" {args.max_tokens} tokens per request, T={args.temperature}, k={args.k}, {args.requests_per_client} "
          f"requests per client, server threads {args.threads}")
    print("| mode | clients | requests/s | output tokens/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | tokens/pass |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        process, url = start_server(mode == "plain", args)
        try:
            asyncio.run(run_clients(url, 1, prompts[:1], argparse.Namespace(**{**vars(args), "requests_per_client": 1})))
            for n in clients:
                before = _counters(url)
                timings, wall = asyncio.run(run_clients(url, n, prompts, args))
                per_pass = _tokens_per_pass(before, _counters(url), len(timings))
                ttft = [t.first_token_s * 1e3 for t in timings]
                tpot = [t.per_token_s * 1e3 for t in timings if t.per_token_s is not None]
                tokens = sum(t.tokens for t in timings)
                print(f"| {mode} | {n} | {len(timings) / wall:.2f} | {tokens / wall:.1f} | "
                      f"{_percentile(ttft, 0.5):.0f} / {_percentile(ttft, 0.99):.0f} | "
                      f"{_percentile(tpot, 0.5):.1f} / {_percentile(tpot, 0.99):.1f} | {per_pass:.2f} |",
                      flush=True)
        finally:
            process.terminate()
            process.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
