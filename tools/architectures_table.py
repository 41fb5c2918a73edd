#!/usr/bin/env python
"""Regenerate the architecture tables from the results of python_tests/architectures.check_architecture:
docs/architectures.md (every decoder architecture of transformers' causal-LM mapping: supported,
refused with the reason, or skipped with the reason) and README.md's list of supported architectures
(between its ``architectures`` markers). python_tests/test_architectures.py checks that both still
match what the code does.

    python tools/architectures_table.py            # about a minute on one CPU thread
    python tools/architectures_table.py --check    # compare with both files, write nothing (exit 1 if stale)
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_tests"))

DOC = os.path.join(ROOT, "docs", "architectures.md")
README = os.path.join(ROOT, "README.md")
START, END = "<!-- architectures:start -->", "<!-- architectures:end -->"


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python tools/architectures_table.py", description=__doc__.split("\n\n")[0],
        epilog="Without --check it writes both files in place.")
    parser.add_argument("--check", action="store_true",
                        help="compare what the checks give with docs/architectures.md and README.md's list, write "
                        "nothing, and exit 1 naming each file that differs")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch
    import transformers

    from architectures import causal_lm_types, check_architecture

    torch.set_num_threads(1)
    rows = []
    for model_type in causal_lm_types():
        status, detail = check_architecture(model_type)
        print(f"{model_type}: {status} {detail}", flush=True)
        rows.append((model_type, status, " ".join(detail.split())))
    bad = [r for r in rows if r[1] not in ("supported", "refused", "skipped")]
    if bad:
        print("not written: these architectures fail (fix them or refuse them first):", file=sys.stderr)
        for row in bad:
            print("  " + " | ".join(row), file=sys.stderr)
        return 1
    supported = [t for t, s, _ in rows if s == "supported"]
    doc = ("# Architectures\n\n"
           f"Every decoder architecture of transformers {transformers.__version__}'s causal-LM mapping, "
           "built tiny from its config class\n(python_tests/architectures.py) and run by "
           "python_tests/test_architectures.py: *supported* means greedy speculative\ndecoding (k = 3, "
           "two ragged prompts longer than the sliding windows) gives HF's greedy tokens; *refused* means\n"
           "generate() refuses it before decoding with the error shown; *skipped* means it cannot be built "
           "tiny or is\nnot a language model of its own. Regenerate with `python tools/architectures_table.py`."
           "\n\n"
           f"transformers: {transformers.__version__}\n\n"
           "| model type | status | runner, or why not |\n|---|---|---|\n"
           + "".join(f"| `{model_type}` | {status} | {detail.replace('|', '/')} |\n"
                     for model_type, status, detail in rows))
    with open(README, encoding="utf-8") as f:
        old_readme = f.read()
    listing = (f"{START}\n{len(supported)} of {len(rows)} (transformers {transformers.__version__}): "
               + ", ".join(f"`{t}`" for t in supported) + f".\n{END}")
    head, rest = old_readme.split(START, 1)
    readme = head + listing + rest.split(END, 1)[1]
    if args.check:
        with open(DOC, encoding="utf-8") as f:
            stale = [name for name, old, new in (("docs/architectures.md", f.read(), doc),
                                                 ("README.md", old_readme, readme)) if old != new]
        for name in stale:
            print(f"{name} differs from what the checks give: run python tools/architectures_table.py",
                  file=sys.stderr)
        if not stale:
            print(f"docs/architectures.md and README.md match: {len(supported)} supported of {len(rows)}")
        return 1 if stale else 0
    with open(DOC, "w", encoding="utf-8") as f:
        f.write(doc)
    with open(README, "w", encoding="utf-8") as f:
        f.write(readme)
    print(f"wrote {DOC} and README.md: {len(supported)} supported of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
