#!/usr/bin/env python
"""Side-by-side generation benchmark: the same as ``specdec bench`` (specdec_ext/bench/compare.py, where
the methods, workloads and columns are described). Results: BENCHMARKS.md."""
import sys

from specdec_ext.bench import main

if __name__ == "__main__":
    sys.exit(main())
