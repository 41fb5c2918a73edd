#!/usr/bin/env python
"""Regenerate the architecture tables from the results of python_tests/architectures.check_architecture:
docs/architectures.md (every decoder architecture of transformers' causal-LM mapping: supported,
refused with the reason, or skipped with the reason) and README.md's list of supported architectures
(between its ``architectures`` markers). python_tests/test_architectures.py checks that both still
match what the code does.

    python tools/architectures_table.py            # about a minute on one CPU thread
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_tests"))

DOC = os.path.join(ROOT, "docs", "architectures.md")
README = os.path.join(ROOT, "README.md")
START, END = "<!-- architectures:start -->", "<!-- architectures:end -->"


def main() -> int:
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
    with open(DOC, "w", encoding="utf-8") as f:
        f.write("# Architectures\n\n"
                f"Every decoder architecture of transformers {transformers.__version__}'s causal-LM mapping, "
                "built tiny from its config class\n(python_tests/architectures.py) and run by "
                "python_tests/test_architectures.py: *supported* means greedy speculative\ndecoding (k = 3, "
                "two ragged prompts longer than the sliding windows) gives HF's greedy tokens; *refused* means\n"
                "generate() refuses it before decoding with the error shown; *skipped* means it cannot be built "
                "tiny or is\nnot a language model of its own. Regenerate with `python tools/architectures_table.py`."
                "\n\n")
        f.write(f"transformers: {transformers.__version__}\n\n")
        f.write("| model type | status | runner, or why not |\n|---|---|---|\n")
        for model_type, status, detail in rows:
            f.write(f"| `{model_type}` | {status} | {detail.replace('|', '/')} |\n")
    with open(README, encoding="utf-8") as f:
        readme = f.read()
    listing = (f"{START}\n{len(supported)} of {len(rows)} (transformers {transformers.__version__}): "
               + ", ".join(f"`{t}`" for t in supported) + f".\n{END}")
    head, rest = readme.split(START, 1)
    readme = head + listing + rest.split(END, 1)[1]
    with open(README, "w", encoding="utf-8") as f:
        f.write(readme)
    print(f"wrote {DOC} and README.md: {len(supported)} supported of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
