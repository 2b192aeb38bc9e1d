"""Command-line value types and the usage error, shared by the CLI and the benchmarks.

A value that cannot be right (a zero count, a malformed address) is refused by argparse
itself: exit 2 with a message naming the flag, before anything runs. `UsageError` is the
same for what argparse cannot tell (options that contradict each other).
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Callable
from pathlib import Path

from hicache.endpoint import parse_address
from hicache.errors import HicacheError


class UsageError(Exception):
    """Command-line options that cannot go together: exit 2, like argparse's own errors."""


def _int_at_least(value: str, lo: int) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number") from None
    if n < lo:
        raise argparse.ArgumentTypeError(f"{n} (at least {lo})")
    return n


def positive_int(value: str) -> int:
    return _int_at_least(value, 1)


def nonnegative_int(value: str) -> int:
    return _int_at_least(value, 0)


def positive_float(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} (a number above 0)")
    return x


def address(value: str) -> str:
    """unix:///path or host:port; a malformed one is a usage error (exit 2), not an
    unreachable daemon."""
    try:
        parse_address(value)
    except HicacheError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def output_file(value: str) -> str:
    """A file a command writes when it ends (a benchmark's figures, its plot): checked
    before anything runs, or a run of minutes would fail only at its end. Its folder must
    exist and take writes; the file is neither created nor truncated here."""
    if not value:
        raise argparse.ArgumentTypeError("an empty path names no file")
    path = Path(value)
    folder = path.parent
    try:
        mode: int | None = os.stat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # (a folder on the way this user may not enter, a loop)
        raise argparse.ArgumentTypeError(f"{value!r}: {e.strerror}") from None
    if mode is not None and stat.S_ISDIR(mode):
        raise argparse.ArgumentTypeError(f"{value!r} is a directory, not a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r}: no folder {str(folder)!r} to write it in")
    if mode is not None and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{value!r} exists and is not writable")
    if mode is None and not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{value!r}: the folder {str(folder)!r} is not writable")
    return value


def one_of(names: tuple[str, ...]) -> Callable[[str], str]:
    """A comma-separated list of some of `names` (at least one, each known)."""

    def parse(value: str) -> str:
        given = [n.strip() for n in value.split(",") if n.strip()]
        unknown = [n for n in given if n not in names]
        if unknown or not given:
            raise argparse.ArgumentTypeError(
                f"{', '.join(map(repr, unknown)) or 'nothing'} given; choose from {', '.join(names)}")
        return ",".join(given)

    return parse
