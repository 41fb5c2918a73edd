#!/usr/bin/env python
"""What a change costs a generate() call, old tree against new: two package directories (each a checkout holding
a built ``specdec_ext``, its own ``_C`` beside it), alternated process by process over rounds, per instruction-set
path (SPECDEC_CPU_ISA), on the bundled pair in bf16, one thread, greedy but the last case; prints ms per call of
each and the median over the rounds of new / old per case.

    git worktree add /tmp/old <commit> && cp <that commit's built _C*.so> /tmp/old/specdec_ext/
    python benchmarks/ab_per_call.py --old /tmp/old --new . [--isa native avx2 portable] [--rounds 3]

A case's calls run 3 prompts x ``--repeats`` times after one warm-up each; its figure is the median ms per call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CASES = {  # name -> generate() keywords (None: plain_generate)
    "plain 64": dict(plain=True, max_new_tokens=64),
    "k=4 64": dict(k=4, max_new_tokens=64),
    'k="auto" 64': dict(k="auto", max_new_tokens=64),
    "plain 8": dict(plain=True, max_new_tokens=8),
    "k=4 8": dict(k=4, max_new_tokens=8),
    "T=0.8 k=4 32": dict(k=4, max_new_tokens=32, temperature=0.8, seed=1),
}
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n"]

CHILD = r"""
import json, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
import specdec_ext
from specdec_ext.generate import generate, plain_generate
cases, prompts, repeats = json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4])
target, draft, tok = specdec_ext.load_default_pair(dtype=torch.bfloat16)
out = {"isa": specdec_ext.ops.cpu_isa(), "file": specdec_ext.__file__}
for name, kw in cases.items():
    kw = dict(kw)
    plain = kw.pop("plain", False)
    call = (lambda p: plain_generate(p, target, tokenizer=tok, eos_token_id=False, **kw)) if plain else \
           (lambda p: generate(p, target, draft, tokenizer=tok, eos_token_id=False, **kw))
    times = []
    for p in prompts:
        call(p)
        for _ in range(repeats):
            t0 = time.perf_counter(); call(p); times.append((time.perf_counter() - t0) * 1e3)
    out[name] = statistics.median(times)
print(json.dumps(out))
"""


def run(package: str, isa: str, repeats: int) -> dict:
    env = dict(os.environ)
    env.pop("SPECDEC_CPU_ISA", None)
    if isa != "native":
        env["SPECDEC_CPU_ISA"] = isa
    done = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(package), json.dumps(CASES), json.dumps(PROMPTS),
                           str(repeats)], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="directory holding the old tree's specdec_ext (built)")
    p.add_argument("--new", required=True, help="directory holding the new tree's specdec_ext (built)")
    p.add_argument("--isa", nargs="+", default=["native", "avx2", "portable"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"| path | {' | '.join(CASES)} |")
    print("|---|" + "---|" * len(CASES))
    for isa in args.isa:
        ratios = {name: [] for name in CASES}
        path = isa
        for _ in range(args.rounds):
            old, new = run(args.old, isa, args.repeats), run(args.new, isa, args.repeats)
            path = new["isa"]
            for name in CASES:
                ratios[name].append(new[name] / old[name])
        print(f"| {path}{'' if isa == 'native' else ' (forced)'} | "
              + " | ".join(f"{statistics.median(r):.3f}" for r in ratios.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
