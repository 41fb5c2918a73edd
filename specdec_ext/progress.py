"""Progress bars of long work (training, audit sampling, bench repeats, long generations).

A bar goes to stderr, and only where someone watches it: stderr is a terminal and nobody asked for
quiet. stdout carries the reports and generated text that other programs read, so no bar goes there.
tqdm comes with transformers (one of its requirements), so it is a plain dependency here.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

from tqdm import tqdm

REFRESH_S = 0.5  # a bar redraws at most twice a second; an update in between is a counter increment


def progress_wanted(quiet: bool = False) -> bool:
    """True when a bar would be seen: not ``quiet`` and stderr is a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return not quiet and bool(isatty and isatty())


def progress_bar(total: Optional[float], description: str, *, unit: str = "it", show: Optional[bool] = None,
                 delay_s: float = 0.0, leave: bool = True) -> tqdm:
    """A tqdm bar on stderr (``show`` None: ``progress_wanted()``; hidden, its update is a no-op).

    ``total`` may be None (unknown yet; set ``bar.total`` later); ``delay_s``: draw nothing before then
    (for work that is usually short)."""
    if show is None:
        show = progress_wanted()
    return tqdm(total=total, desc=description, unit=unit, file=sys.stderr, disable=not show, leave=leave,
                mininterval=REFRESH_S, delay=delay_s, dynamic_ncols=True)


def write_line(text: str) -> None:
    """Print a line to stdout without tearing a progress bar drawn on stderr (the bar is redrawn below)."""
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


@contextlib.contextmanager
def hf_progress_bars_off(off: bool = True):
    """With ``off``: transformers' own bars (weight loading) hidden for the duration, as they were after."""
    from transformers.utils import logging

    was_on = logging.is_progress_bar_enabled()
    if off:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if off and was_on:
            logging.enable_progress_bar()
