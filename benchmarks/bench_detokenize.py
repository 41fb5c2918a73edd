"""Host time of a row's text as it grows: the whole row decoded at every step (what the stop checks, generate()'s
stream and the server's TextStream did) against stops.IncrementalText (a window of the last tokens), side by side.

    python benchmarks/bench_detokenize.py [--lengths 2000,8000,16000] [--repeats 3]

The bundled tokenizer; the tokens of the project's own sources, pushed in steps of 1-5 tokens (a speculative
step's accepted run); per length: tokens passed to the tokenizer's decode, and the median time of the whole
stream over the repeats, with a stop string that never matches (the check reads the text at every step).
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import statistics
import sys
import time
from typing import Callable, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEVER = "@@never@@"


def source_tokens(tokenizer, count: int) -> List[int]:
    text = "".join(open(path, encoding="utf-8").read() for path in sorted(glob.glob(os.path.join(ROOT, "specdec_ext", "*.py"))))
    ids = tokenizer(text)["input_ids"]
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


def steps(tokens: List[int], seed: int = 0):
    rng, i = random.Random(seed), 0
    while i < len(tokens):
        n = rng.randint(1, 5)
        yield tokens[i:i + n]
        i += n


def whole_row(decode: Callable[[List[int]], str], tokens: List[int]) -> None:
    """The text of the row at every step, decoded whole, and the stop search over its end."""
    row: List[int] = []
    for new in steps(tokens):
        before = len(decode(row))
        row.extend(new)
        text = decode(row)
        text.find(NEVER, max(0, before - len(NEVER)))


def incremental(decode: Callable[[List[int]], str], tokens: List[int]) -> None:
    from specdec_ext.stops import IncrementalText

    text = IncrementalText(decode)
    for new in steps(tokens):
        before = len(text)
        text.extend(new)
        text.text_from(max(0, before - len(NEVER))).find(NEVER)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2000,8000,16000", help="stream lengths in tokens (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per method; medians (default: 3)")
    args = p.parse_args(argv)
    from specdec_ext.default_pair import load_default_pair

    tokenizer = load_default_pair()[2]
    counted = {"tokens": 0}

    def decode(ids: List[int]) -> str:
        counted["tokens"] += len(ids)
        return tokenizer.decode(ids, skip_special_tokens=True)

    print(f"{'tokens':>7} {'method':<12} {'decoded tokens':>15} {'per token':>10} {'ms':>9} {'us/token':>9} {'ratio':>7}")
    for length in [int(n) for n in args.lengths.split(",")]:
        tokens = source_tokens(tokenizer, length)
        times = {}
        for name, run in (("whole row", whole_row), ("incremental", incremental)):
            spent = []
            for _ in range(args.repeats):
                counted["tokens"] = 0
                begin = time.perf_counter()
                run(decode, tokens)
                spent.append(time.perf_counter() - begin)
            times[name] = statistics.median(spent)
            ratio = times["whole row"] / times[name]
            print(f"{length:>7} {name:<12} {counted['tokens']:>15,} {counted['tokens'] / length:>10.1f} "
                  f"{times[name] * 1e3:>9.1f} {times[name] / length * 1e6:>9.2f} {ratio:>6.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
