"""argparse types shared by the commands (cli.py, bench/compare.py, eagle/command.py): a bad value is a usage
error naming the option, never a traceback from deep inside the run; OneLineParser prints it as one line."""
from __future__ import annotations

import argparse

USAGE_ERROR_STATUS = 2  # argparse's exit status for a usage error (other bad input exits with 1)


def usage_error_line(prog: str, message: str, listing: str = "options") -> str:
    """A usage error as one line: "PROG: error: MESSAGE (PROG --help lists the LISTING)"."""
    return f"{prog}: error: {' '.join(str(message).split())} ({prog} --help lists the {listing})"


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage error is one line on stderr naming the command, the option and the
    problem (``usage_error_line``), exit status 2, without argparse's usage block above it (``--help``
    shows the usage). Its subcommands' parsers (add_subparsers) print theirs so too, and each names itself for an
    argument it does not know (argparse left that to the root parser: "specdec: error: unrecognized arguments",
    no command named)."""

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("parser_class", _SubcommandParser)
        return super().add_subparsers(**kwargs)

    def error(self, message: str):
        listing = "commands" if self._subparsers is not None else "options"
        self.exit(USAGE_ERROR_STATUS, usage_error_line(self.prog, message, listing) + "\n")


class _SubcommandParser(OneLineParser):
    """A subcommand's parser: an argument it does not know is its own usage error."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


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


def int_in(low: int, high: int):
    """An int in [``low``, ``high``] (a port)."""
    def parse(value: str) -> int:
        return _parsed(value, int, lambda n: low <= n <= high, f"an int in [{low}, {high}]")
    parse.__name__ = f"int in [{low}, {high}]"
    return parse


def positive(value: str) -> float:
    """A finite number > 0 (a time budget)."""
    return _parsed(value, float, lambda x: 0.0 < x < float("inf"), "a finite number > 0")


def non_negative(value: str) -> float:
    """A finite number >= 0 (a temperature)."""
    return _parsed(value, float, lambda x: 0.0 <= x < float("inf"), "a finite number >= 0")


def fraction(value: str) -> float:
    """A number in [0, 1] (a share of another value)."""
    return _parsed(value, float, lambda x: 0.0 <= x <= 1.0, "a number in [0, 1]")


def below_one(value: str) -> float:
    """A number in [0, 1) (a probability threshold where 1 would drop everything)."""
    return _parsed(value, float, lambda x: 0.0 <= x < 1.0, "a number in [0, 1)")


def tree_shape(value: str):
    """A draft tree 'B,D,N': three ints >= 1."""
    try:
        shape = tuple(int(x) for x in value.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected B,D,N (three ints >= 1), got {value!r}")
    return shape


def tree_list(value: str):
    """Draft trees 'B,D,N;B,D,N...' (each as ``tree_shape``), at least one."""
    trees = [tree_shape(part) for part in value.split(";") if part.strip()]
    if not trees:
        raise argparse.ArgumentTypeError(f"expected B,D,N trees separated by ';', got {value!r}")
    return trees


def subset_of(choices):
    """A comma-separated non-empty subset of ``choices`` (kept in the order given)."""
    def parse(value: str):
        picked = [part.strip() for part in value.split(",") if part.strip()]
        unknown = [part for part in picked if part not in choices]
        if not picked or unknown:
            raise argparse.ArgumentTypeError(f"expected one or more of {','.join(choices)} (comma-separated), got "
                                             f"{value!r}")
        return picked
    parse.__name__ = f"subset of {','.join(choices)}"
    return parse


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


def read_text_option(option: str, path: str) -> str:
    """The UTF-8 text of the file an option names; ValueError naming the option and the problem (a bare
    OSError named neither: "[Errno 2] No such file or directory: 'x'")."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{option}: no such file: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"{option}: {path} is a directory, not a file") from None
    except OSError as error:
        raise ValueError(f"{option}: cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{option}: {path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
