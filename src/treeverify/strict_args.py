"""Subcommand parsers that own their unknown flags.

argparse hands a subparser's unrecognised flags back to the parent, which reports them with the
top level's usage; a user of ``treeverify serve`` or ``treeverify gate`` should see that
subcommand's usage and exit status instead.
"""

from __future__ import annotations

import argparse


def own_unknown_flags(parser: argparse.ArgumentParser) -> None:
    """Make an unknown flag `parser`'s own usage error (its `error`, so its exit status)."""
    known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extras = known(args, namespace)
        if extras:
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        return ns, extras

    parser.parse_known_args = parse_known_args
