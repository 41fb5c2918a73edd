"""What a target pass costs by its shape: a prompt chunk of c tokens against a verify pass of [w, t].

    python benchmarks/bench_pass_cost.py [--widths 1,2,4,8,16] [--tokens 1,2,3,5,9] [--chunks 32,64,128,256]
                                         [--dtype bfloat16] [--threads 1] [--repeats 7] [--device cpu]

The bundled target on the runner the server uses (runner kind "lean" on the CPU, "paged" elsewhere), rows
holding --context tokens of held-out code. Each line: milliseconds per pass (median of --repeats, the
shapes of one table interleaved) and per token. It is the measurement behind the draft length's V(n)
floor (serve/draft_length.py, PassFloor): a pass's time per token does not rise with its tokens, so a
chunk of c tokens bounds every pass of n <= c tokens from below, n x t(c) / c, and where the pass is
compute-bound (a CPU thread from ~16 tokens up) the bound is close.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _timing import machine_description, median_times  # noqa: E402
from specdec_ext.bench.workloads import heldout_prompts  # noqa: E402
from specdec_ext.cli import _in_dtype  # noqa: E402
from specdec_ext.models import default_device, load_models  # noqa: E402
from specdec_ext.runners import make_runner  # noqa: E402


def _ints(text: str) -> List[int]:
    return [int(x) for x in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=_ints, default=[1, 2, 4, 8, 16])
    parser.add_argument("--tokens", type=_ints, default=[1, 2, 3, 5, 9], help="tokens per row of a verify pass")
    parser.add_argument("--chunks", type=_ints, default=[32, 64, 128, 256], help="prompt chunk lengths")
    parser.add_argument("--context", type=int, default=250, help="tokens in each row's cache before a pass")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device or default_device())
    models = _in_dtype(load_models(None, plain=True), args.dtype)
    models.to(str(device))
    widest = max(args.widths)
    longest = max(args.context, max(args.chunks)) + max(args.tokens) + 1
    runner = make_runner("lean" if device.type == "cpu" else "paged", models.target, max_batch_size=widest,
                         max_seq_len=longest)
    texts = [models.tokenizer.encode(text) for _, text in heldout_prompts(8, 40)]
    rows = [(texts[i % len(texts)] * longest)[:max(args.context, max(args.chunks))] for i in range(widest)]
    print(f"# {machine_description(device)}; {args.dtype}, {args.threads} thread(s), context {args.context}, "
          f"runner {type(runner).__name__}, medians of {args.repeats}")
    with torch.no_grad():
        runner.start(rows[:1])

        def chunk(c: int):
            return lambda: (runner.free_rows([0]), runner.start_rows([0], [rows[0][:c]]))

        chunks = median_times({c: chunk(c) for c in args.chunks}, device, args.repeats)
        print("| prompt chunk (tokens) | ms | us per token |\n|---|---|---|")
        for c, seconds in chunks.items():
            print(f"| {c} | {seconds * 1e3:.2f} | {seconds / c * 1e6:.0f} |")
        print("\n| verify pass [w, t] | tokens | ms | us per token |\n|---|---|---|---|")
        for w in args.widths:
            runner.start([row[:args.context] for row in rows[:w]])
            lengths = runner.lengths.clone()

            def verify(t: int, w: int = w):
                ids = torch.ones((w, t), dtype=torch.long, device=device)
                return lambda: (runner.forward(ids), runner.truncate(lengths))

            passes = median_times({t: verify(t) for t in args.tokens}, device, args.repeats)
            for t, seconds in passes.items():
                print(f"| [{w}, {t}] | {w * t} | {seconds * 1e3:.2f} | {seconds / (w * t) * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
