"""argparse types shared by the commands (cli.py, bench/compare.py, eagle/command.py): a bad value is a usage
error naming the option, never a traceback from deep inside the run."""
from __future__ import annotations

import argparse


def _parsed(value: str, convert, valid, expected: str):
    """``convert(value)`` where ``valid`` holds of it, else argparse's usage error saying what was ``expected``."""
    try:
        number = convert(value)
    except ValueError:
        number = None
    if number is None or not valid(number):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    return number


def at_least(low: int):
    """An int >= ``low`` (a count of 0 or less is no request for all of them)."""
    def parse(value: str) -> int:
        return _parsed(value, int, lambda n: n >= low, f"an int >= {low}")
    parse.__name__ = f"int >= {low}"
    return parse


def non_negative(value: str) -> float:
    """A finite number >= 0 (a temperature)."""
    return _parsed(value, float, lambda x: 0.0 <= x < float("inf"), "a finite number >= 0")


def int_list(value: str):
    """Comma-separated ints >= 1 (draft lengths)."""
    try:
        numbers = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {value!r}") from None
    if not numbers or min(numbers) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {value!r}")
    return numbers


def device(value: str) -> str:
    """A device the models can run on here (models.usable_device): "cuda" without CUDA is a usage error (it
    raised "Torch not compiled with CUDA enabled" from inside the run)."""
    from .models import usable_device

    try:
        usable_device(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def probability(value: str) -> float:
    """A number in (0, 1) (a significance level)."""
    return _parsed(value, float, lambda x: 0.0 < x < 1.0, "a number in (0, 1)")
