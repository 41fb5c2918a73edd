"""Ragged prompts prefilled three ways: one forward padded to the longest, in groups of similar lengths (the
lean runner's ``prefill_groups``, its default), and one forward per prompt.

    python benchmarks/bench_ragged_prefill.py [--prompts 16] [--shortest 150] [--longest 460] [--dtype bfloat16]
                                              [--threads 1] [--repeats 5]

What a server's deferred draft prefills (the rows that joined while speculation was off, started together
when a step first drafts) and a ragged ``start`` cost. The bundled target and draft on the lean runner (CPU),
--prompts prompts of held-out code with lengths spread evenly from --shortest to --longest tokens,
``start_rows`` into free rows; milliseconds (median of --repeats, the three ways interleaved) and
microseconds per prompt token.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from _timing import machine_description, median_times  # noqa: E402
from specdec_ext.bench.workloads import heldout_prompts  # noqa: E402
from specdec_ext.cli import _in_dtype  # noqa: E402
from specdec_ext.models import load_models  # noqa: E402
from specdec_ext.runners import LeanLlamaRunner  # noqa: E402
from specdec_ext.runners.lean import prefill_groups  # noqa: E402

NO_GROUPS = 10 ** 9  # slack and tokens that put every prompt in one group: one padded forward


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--shortest", type=int, default=150)
    parser.add_argument("--longest", type=int, default=460)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not 1 <= args.shortest <= args.longest or args.prompts < 1:
        parser.error("need --prompts >= 1 and 1 <= --shortest <= --longest")
    torch.set_num_threads(args.threads)
    models = _in_dtype(load_models(), args.dtype)
    texts = [models.tokenizer.encode(text) for _, text in heldout_prompts(8, 40)]
    step = (args.longest - args.shortest) / max(args.prompts - 1, 1)
    lengths = [round(args.shortest + i * step) for i in range(args.prompts)]
    prompts = [(texts[i % len(texts)] * args.longest)[:n] for i, n in enumerate(lengths)]
    tokens = sum(lengths)
    groups = prefill_groups(lengths)
    print(f"# {machine_description(torch.device('cpu'))}; {args.dtype}, {args.threads} thread(s); {args.prompts} "
          f"prompts of {args.shortest}-{args.longest} tokens ({tokens} in all); grouped: {len(groups)} forwards; "
          f"medians of {args.repeats}")
    print("| model | one padded forward (ms, us/token) | grouped (ms, us/token) | one by one (ms, us/token) | "
          "grouped / padded |\n|---|---|---|---|---|")
    for name, model in (("target", models.target), ("draft", models.draft)):
        runner = LeanLlamaRunner(model, max_batch_size=args.prompts, max_seq_len=args.longest + 8)
        rows = list(range(args.prompts))

        def prefill(ways: str):
            def run():
                if runner.batch_size:
                    runner.free_rows([row for row in rows if row < runner.batch_size and runner.lengths[row] > 0])
                if ways == "one by one":
                    for row, prompt in zip(rows, prompts):
                        runner.start_rows([row], [prompt])
                elif ways == "padded":
                    defaults = prefill_groups.__defaults__
                    prefill_groups.__defaults__ = (NO_GROUPS, NO_GROUPS)
                    try:
                        runner.start_rows(rows, prompts)
                    finally:
                        prefill_groups.__defaults__ = defaults
                else:
                    runner.start_rows(rows, prompts)
            return run

        with torch.no_grad():
            times = median_times({w: prefill(w) for w in ("padded", "grouped", "one by one")}, torch.device("cpu"),
                                 args.repeats)
        cells = [f"{times[w] * 1e3:.1f}, {times[w] / tokens * 1e6:.0f}" for w in ("padded", "grouped", "one by one")]
        print(f"| {name} | " + " | ".join(cells) + f" | {times['grouped'] / times['padded']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
