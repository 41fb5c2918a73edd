"""The bundled pair's training corpus: the ``*.py`` files of Python's stdlib, torch and transformers as
installed, 2% of them held out by a hash of their name (the held-out files are the benchmarks' prompts,
listed in heldout_files.txt as the pair's training run found them). tools/train_default_pair.py trained
the pair on it; ``specdec train-eagle`` continues pieces of it by default."""
from __future__ import annotations

import hashlib
import os
import sysconfig
from typing import List, Tuple

MAX_FILE_BYTES = 512 * 1024  # larger files are generated tables, not code
HELDOUT_PERCENT = 2

__all__ = ["source_trees", "is_heldout", "collect_files", "training_files", "MAX_FILE_BYTES"]


def source_trees() -> List[Tuple[str, str, Tuple[str, ...]]]:
    """(tree name, root, top-level folders left out) of the three trees."""
    import torch
    import transformers

    return [
        ("stdlib", sysconfig.get_paths()["stdlib"], ("test", "site-packages")),
        ("torch", os.path.dirname(torch.__file__), ()),
        ("transformers", os.path.dirname(transformers.__file__), ()),
    ]


def is_heldout(name: str) -> bool:
    """Whether the file named ``tree/relative/path.py`` is held out of training."""
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def collect_files() -> List[Tuple[str, str]]:
    """(name, path) of every usable ``*.py`` file of the three trees, sorted by name."""
    out = []
    for tree, root, excluded_top in source_trees():
        for dirpath, dirnames, filenames in os.walk(root):
            if os.path.relpath(dirpath, root) == ".":
                dirnames[:] = [d for d in dirnames if d not in excluded_top]
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for fn in sorted(filenames):
                path = os.path.join(dirpath, fn)
                if fn.endswith(".py") and os.path.isfile(path) and os.path.getsize(path) <= MAX_FILE_BYTES:
                    out.append((tree + "/" + os.path.relpath(path, root).replace(os.sep, "/"), path))
    out.sort()
    return out


def training_files() -> List[str]:
    """Paths of the corpus's training files (the held-out ones left out), sorted by name."""
    return [path for name, path in collect_files() if not is_heldout(name)]
