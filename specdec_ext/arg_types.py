"""argparse types shared by the commands (cli.py, bench/compare.py, eagle/command.py): a bad value is a usage
error naming the option, never a traceback from deep inside the run."""
from __future__ import annotations

import argparse


def at_least(low: int):
    """An int >= ``low`` (a count of 0 or less is no request for all of them)."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value!r}") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {value!r}")
        return number
    parse.__name__ = f"int >= {low}"
    return parse


def non_negative(value: str) -> float:
    """A finite number >= 0 (a temperature)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value!r}") from None
    if not 0.0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value!r}")
    return number


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
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {value!r}") from None
    if not 0.0 < number < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {value!r}")
    return number
