"""specdec serve under load: N concurrent clients on the bundled pair, speculative against plain decoding.

Each mode starts `specdec serve` in its own process on 127.0.0.1 with its flags (MODES: "speculative" the
server's defaults, k by load and chunked prefill; "plain" the same with ``--draft none``; "whole" k by
load with whole-prompt prefill, ``--prefill-chunk 0``; "fixed" ``-k 4`` with whole-prompt prefill, the
server before issue 30; "slo" the defaults with ``--tpot-slo-ms 50``; "uncalibrated" the defaults without the
start-up request that times every draft length, ``--no-calibrate``), sends one warm-up request, then runs N
closed-loop clients (each sends its next
request when the previous one ended) for every N in --clients. With --repeats R the modes run R times,
interleaved (mode 1, mode 2, ..., mode 1, ...), and the table gives each figure's median over the runs. Requests are
streamed completions of held-out code prompts (the first lines of stdlib files the pair never saw), greedy
by default, ``ignore_eos`` so that every request returns exactly --max-tokens tokens.

Reported per (mode, N): requests/s and output tokens/s over the wall time of the N clients, p50 / p99
time to first token (request sent -> first streamed text), p50 / p99 time per output token (per request:
(last token - first token) / (tokens - 1)), the server's tokens per target pass and its draft lengths
(mean k per decode step, share of plain steps; /metrics).

    python benchmarks/bench_serve.py                       # N = 1, 4, 16, 32; 3 requests per client
    python benchmarks/bench_serve.py --clients 1,4 --requests-per-client 2 --max-tokens 32 --modes speculative,plain
    python benchmarks/bench_serve.py --device cuda --clients 1,32 --modes speculative,plain   # a GPU: CUDA graphs
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
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import httpx

import torch

from specdec_ext.cli import BUNDLED_MODEL_NAME, heldout_prompts
from specdec_ext.models import default_device
from specdec_ext.ops import cpu_isa

START_TIMEOUT_S = 300.0
MODES = {"speculative": [], "plain": ["--draft", "none"], "whole": ["--prefill-chunk", "0"],
         "fixed": ["-k", "4", "--prefill-chunk", "0"], "slo": ["--tpot-slo-ms", "50"],
         "uncalibrated": ["--no-calibrate"]}
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


def start_server(mode: str, args) -> tuple:
    """`specdec serve` in a child process; (process, url) once /health answers."""
    port = _free_port()
    command = [sys.executable, "-m", "specdec_ext", "serve", "--port", str(port), "--threads", str(args.threads),
               "--max-rows", str(args.max_rows), "--max-seq-len", str(args.max_seq_len), "--log-level", "warning"]
    if args.device is not None:
        command += ["--device", args.device]
    command += MODES[mode]
    if args.dtype is not None:
        command += ["--dtype", args.dtype]
    if args.prefill_chunk is not None and "--prefill-chunk" not in MODES[mode]:
        command += ["--prefill-chunk", str(args.prefill_chunk)]
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
    """The server's unlabelled counters (/metrics), by name, and its decode steps by draft length under
    "k=<k>"."""
    out: Dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("specdec_draft_length_steps_total{"):
            k = name.split('k="')[1].split('"')[0]
            out[f"k={k}"] = out.get(f"k={k}", 0.0) + float(value)
        elif line.startswith("specdec_") and "{" not in line and name.endswith("_total"):
            out[name] = float(value)
    return out


def _draft_lengths(before: dict, after: dict) -> Tuple[float, float]:
    """(mean k per decode step, share of steps with k = 0) over a run."""
    steps = {int(name[2:]): after[name] - before.get(name, 0.0) for name in after if name.startswith("k=")}
    total = sum(steps.values())
    if not total:
        return float("nan"), float("nan")
    return sum(k * n for k, n in steps.items()) / total, steps.get(0, 0.0) / total


def _tokens_per_pass(before: dict, after: dict, requests: int) -> float:
    """Tokens per row per target pass over a run: the decoded tokens (each request's first comes from its
    prefill) over the row-passes."""
    delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)
    passes = delta("specdec_row_target_passes_total")
    return (delta("specdec_generated_tokens_total") - requests) / passes if passes else float("nan")


def run_mode(mode: str, clients: List[int], prompts: List[str], args) -> Dict[int, dict]:
    """One server of ``mode``: a warm-up request, then every N of ``clients``; {N: figures}."""
    process, url = start_server(mode, args)
    out = {}
    try:
        asyncio.run(run_clients(url, 1, prompts[:1], argparse.Namespace(**{**vars(args), "requests_per_client": 1})))
        for n in clients:
            before = _counters(url)
            timings, wall = asyncio.run(run_clients(url, n, prompts, args))
            after = _counters(url)
            ttft = [t.first_token_s * 1e3 for t in timings]
            tpot = [t.per_token_s * 1e3 for t in timings if t.per_token_s is not None]
            mean_k, off = _draft_lengths(before, after)
            out[n] = {"requests/s": len(timings) / wall, "tokens/s": sum(t.tokens for t in timings) / wall,
                      "ttft50": _percentile(ttft, 0.5), "ttft99": _percentile(ttft, 0.99),
                      "tpot50": _percentile(tpot, 0.5), "tpot99": _percentile(tpot, 0.99),
                      "per_pass": _tokens_per_pass(before, after, len(timings)), "mean_k": mean_k, "off": off}
            print(f"# run: {mode} N={n}: " + ", ".join(f"{k} {v:.3g}" for k, v in out[n].items()), flush=True)
    finally:
        process.terminate()
        process.wait(60)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4,16,32", help="concurrent clients, comma-separated (default: 1,4,16,32)")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-rows", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads (default: 1)")
    parser.add_argument("--device", default=None, help="the servers' --device: cpu, cuda (default: theirs, cuda "
                        "where torch sees a GPU); on CUDA the steps run in CUDA graphs")
    parser.add_argument("--prompt-lines", type=int, default=20)
    parser.add_argument("--modes", default="speculative,plain,whole", help=f"of {', '.join(MODES)} (default: "
                        "speculative,plain,whole)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="the servers' --prefill-chunk where the mode does not set it (default: theirs)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of every mode (default: 1)")
    parser.add_argument("--dtype", default=None, choices=["auto", "bfloat16", "float32"],
                        help="the servers' --dtype (default: theirs, auto: bf16 for the bundled pair)")
    args = parser.parse_args(argv)
    clients = [int(x) for x in args.clients.split(",")]
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"bench_serve: unknown mode {unknown[0]!r}: choose from {', '.join(MODES)}")
    prompts = [text for _, text in heldout_prompts(8, args.prompt_lines)]
    device = args.device or default_device()
    where = (f"{torch.cuda.get_device_name(torch.device(device))}" if device.startswith("cuda")
             else f"CPU path {cpu_isa()}")
    print(f"# {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, python {platform.python_version()};"
          f" device {device} ({where});"
          f" {args.max_tokens} tokens per request, T={args.temperature}, {args.requests_per_client} requests per "
          f"client, server threads {args.threads}, dtype {args.dtype or 'auto'}, prefill chunk {args.prefill_chunk or 'default'}, {args.repeats} interleaved run(s) per mode (medians)")
    runs: Dict[str, List[Dict[int, dict]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            runs[mode].append(run_mode(mode, clients, prompts, args))
    print("| mode | clients | requests/s | output tokens/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | tokens/pass "
          "| mean k / plain steps |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        for n in clients:
            m = {key: statistics.median(run[n][key] for run in runs[mode]) for key in runs[mode][0][n]}
            print(f"| {mode} | {n} | {m['requests/s']:.2f} | {m['tokens/s']:.1f} | {m['ttft50']:.0f} / "
                  f"{m['ttft99']:.0f} | {m['tpot50']:.1f} / {m['tpot99']:.1f} | {m['per_pass']:.2f} | "
                  f"{m['mean_k']:.2f} / {100 * m['off']:.0f}% |")
    if "plain" in modes:
        print("\nratios to plain: output tokens/s (of the medians; the median of the runs' paired ratios, run i "
              "against plain's run i), TPOT p99 (medians)")
        for mode in (m for m in modes if m != "plain"):
            for n in clients:
                med = lambda key, which: statistics.median(run[n][key] for run in runs[which])
                paired = statistics.median(a[n]["tokens/s"] / b[n]["tokens/s"]
                                           for a, b in zip(runs[mode], runs["plain"]))
                print(f"  {mode} N={n}: {med('tokens/s', mode) / med('tokens/s', 'plain'):.2f}x tok/s (paired "
                      f"{paired:.2f}x), TPOT p99 {med('tpot99', mode):.1f} vs {med('tpot99', 'plain'):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
