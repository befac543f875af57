"""The ``treeverify`` command line (also ``python -m treeverify``).

Subcommands live in their own modules: each entry of ``COMMANDS`` names a module with
``add_parser(subparsers)`` and ``run(args) -> int``. Modules are imported when the parser is
built, not when this file is imported; one that does not exist in this install is left out,
and one that exists but cannot import (a missing optional dependency) is listed with its error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from treeverify import __version__, env

# (subcommand, module providing add_parser/run)
COMMANDS: list[tuple[str, str]] = [
    ("check", "treeverify.check"),
    ("kernels", "treeverify.kernels.cuda.cli"),
    ("bench", "treeverify.bench.cli"),
    ("serve", "treeverify.server.cli"),
    ("unit", "treeverify.server.unit"),
    ("gate", "treeverify.gate.cli"),
]


def _load(module: str):
    """The module, None if it (or a package above it) is absent, or the ImportError raised."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        parts = module.split(".")
        if exc.name in {".".join(parts[:i]) for i in range(2, len(parts) + 1)}:
            return None
        return exc
    except ImportError as exc:
        return exc


def _unavailable(exc: ImportError):
    def run(args: argparse.Namespace) -> int:
        print(f"treeverify {args.command}: unavailable here: {exc}", file=sys.stderr)
        return 2

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treeverify", description="Tree speculative-decoding verify attention."
    )
    parser.add_argument("--version", action="version", version=f"treeverify {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the treeverify version")
    version.set_defaults(run=lambda args: print(f"treeverify {__version__}") or 0)
    for name, module_name in COMMANDS:
        module = _load(module_name)
        if module is None:
            continue
        if isinstance(module, ImportError):
            p = sub.add_parser(name, help=f"(unavailable: {module})")
            p.set_defaults(run=_unavailable(module))
        else:
            module.add_parser(sub).set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        env.configure_logging()
    except ValueError as exc:
        print(f"treeverify: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help()
        return 2
    return int(args.run(args))
