"""The texts ``specdec train-eagle`` gives the target to continue: pieces of text files."""
from __future__ import annotations

import os
import random
from typing import List, Optional, Sequence

__all__ = ["text_files", "read_pieces"]

PIECE_STRIDE = 4  # a piece starts every PIECE_STRIDE pieces' length into a file: pieces of one file do not overlap


def text_files(paths: Optional[Sequence[str]]) -> List[str]:
    """The files ``paths`` name (a directory: every file under it, sorted), or, for None, the bundled pair's
    training files (default_pair/corpus.py). A path that does not exist is an error naming it."""
    if paths is None:
        from ..default_pair.corpus import training_files

        return training_files()
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"train-eagle: --data {path!r} is neither a file nor a directory")
    if not files:
        raise ValueError(f"train-eagle: --data {list(paths)} holds no files")
    return files


def read_pieces(files: Sequence[str], pieces: int, chars: int, seed: int) -> List[str]:
    """Up to ``pieces`` pieces of ``chars`` characters from ``files``, visited in an order shuffled by
    ``seed`` (bytes that are not UTF-8 replaced)."""
    order = list(files)
    random.Random(seed).shuffle(order)
    out = []
    for path in order:
        with open(path, errors="replace") as f:
            text = f.read()
        for start in range(0, max(len(text) - chars + 1, 0), chars * PIECE_STRIDE):  # (a text of chars: one piece)
            out.append(text[start:start + chars])
            if len(out) == pieces:
                return out
    return out
