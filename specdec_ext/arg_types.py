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
    """A torch device this process can use: "cuda" on a torch without CUDA, or on a machine without a GPU, is a
    usage error (it raised "Torch not compiled with CUDA enabled" from inside the run)."""
    import torch

    try:
        parsed = torch.device(value)
    except RuntimeError as error:
        raise argparse.ArgumentTypeError(f"not a device: {value!r} ({error})") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no GPU"
        raise argparse.ArgumentTypeError(f"{value!r}: {why}")
    return value
