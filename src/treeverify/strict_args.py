"""Argument checks shared by the subcommands.

argparse hands a subparser's unrecognised flags back to the parent, which reports them with the
top level's usage; a user of ``treeverify serve`` or ``treeverify gate`` should see that
subcommand's usage and exit status instead. A report file is checked when the flags are parsed,
so a typo in its path fails before a long run rather than after it.
"""

from __future__ import annotations

import argparse
import os


def own_unknown_flags(parser: argparse.ArgumentParser) -> None:
    """Make an unknown flag `parser`'s own usage error (its `error`, so its exit status)."""
    known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extras = known(args, namespace)
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    parser.parse_known_args = parse_known_args


def output_file_problem(path: str) -> str | None:
    """Why `path` cannot be written as a new or replaced file, or None if it can."""
    if not path:
        return "empty path"
    if os.path.isdir(path):
        return f"{path} is a directory"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"{path}: directory {parent} does not exist"
    target = path if os.path.exists(path) else parent
    if not os.access(target, os.W_OK):
        return f"{path}: not writable"
    return None


def output_file(value: str) -> str:
    """argparse type for a file written at the end of a run."""
    problem = output_file_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def int_at_least(low: int, high: int | None = None):
    """An argparse type: an int >= `low`, and <= `high` when given (serve's counts, unit's
    seconds, check's seed)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if high is not None and not low <= n <= high:
            raise argparse.ArgumentTypeError(f"must be in {low}..{high}, got {n}")
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n

    parse.__name__ = "int"
    return parse
