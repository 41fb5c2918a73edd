"""``specdec bench``: our drafters next to HF plain, assisted and prompt-lookup generation on the same
pair and prompts (compare.py), on the held-out code and edit workloads of the bundled pair
(workloads.py). Installed with the package; ``benchmarks/bench_generate.py`` runs the same."""
from .compare import main

__all__ = ["main"]
