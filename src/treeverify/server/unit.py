"""``treeverify unit``: print a systemd unit that runs ``treeverify serve`` (Type=notify).

    treeverify unit -- --model /models/Kimi-K2 --port 30000 > treeverify.service

The server sends READY=1 only once it answers requests, so ``TimeoutStartSec`` must cover
loading the largest model (default 1800 s); ``Restart=on-failure`` with ``RestartSec`` restarts a
crashed server (a crash loop shows as ``activating (auto-restart)`` with a growing NRestarts).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shutil
import sys

from treeverify.strict_args import int_at_least

# a newline would end the directive and start another one in the unit file
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NAME = re.compile(r"[A-Za-z0-9_.@-]+")


def _one_line(value: str) -> str:
    if _CONTROL.search(value):
        raise argparse.ArgumentTypeError(f"control characters (newline, tab, ...) in {value!r}")
    return value


def _absolute_dir(value: str) -> str:
    """WorkingDirectory=: systemd takes an absolute path only (a relative one was written and
    the unit refused at start; a new user's audit)."""
    value = _one_line(value)
    if not value.startswith("/"):
        raise argparse.ArgumentTypeError(f"{value!r}: systemd needs an absolute path")
    return value


def _name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"{value!r}: only letters, digits and '-', '_', '.', '@' are allowed"
        )
    return value


_seconds = int_at_least(0)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("unit", help="print a systemd unit (Type=notify) for the server")
    p.add_argument("--name", type=_name, default="treeverify", help="Description= suffix")
    p.add_argument(
        "--exec",
        dest="executable",
        type=_one_line,
        help="the treeverify executable (default: found on PATH, else python -m)",
    )
    p.add_argument("--user", type=_one_line, help="User= to run as")
    p.add_argument("--working-directory", type=_absolute_dir, help="WorkingDirectory= (absolute)")
    p.add_argument(
        "--env",
        action="append",
        type=_one_line,
        default=[],
        metavar="KEY=VALUE",
        help="Environment= (repeatable)",
    )
    p.add_argument(
        "--timeout-start-sec",
        type=_seconds,
        default=1800,
        help="TimeoutStartSec (model load + warmup must fit)",
    )
    p.add_argument("--timeout-stop-sec", type=_seconds, default=60)
    p.add_argument("--restart-sec", type=_seconds, default=10)
    p.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="arguments for 'treeverify serve' (after --)"
    )
    return p


def _quote(arg: str) -> str:
    """An ExecStart= word: double-quoted when it holds spaces, quotes, backslashes or '$'/'%'."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _serve_args(args: argparse.Namespace) -> list[str]:
    serve_args = list(args.serve_args or [])
    return serve_args[1:] if serve_args[:1] == ["--"] else serve_args


class _ServeArgsError(Exception):
    pass


def serve_args_problem(serve_args: list[str]) -> str | None:
    """What serve's own parser says about these arguments, or None if it takes them."""
    from treeverify.server import cli as serve_cli

    bad = next((a for a in serve_args if _CONTROL.search(a)), None)
    if bad is not None:
        return f"control characters (newline, tab, ...) in {bad!r}"
    parser = argparse.ArgumentParser(prog="treeverify")
    serve = serve_cli.add_parser(parser.add_subparsers(dest="command"))

    def error(message: str):
        raise _ServeArgsError(message)

    serve.error = error  # its message, not its usage and exit
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # --help would print, then exit 0
            parser.parse_args(["serve", *serve_args])
    except _ServeArgsError as exc:
        return str(exc)
    except SystemExit:
        return "--help/-h prints serve's help; it runs no server"
    return None


def render(args: argparse.Namespace) -> str:
    serve_args = _serve_args(args)
    if args.executable:
        cmd = [args.executable, "serve"]
    elif shutil.which("treeverify"):
        cmd = [shutil.which("treeverify"), "serve"]
    else:
        cmd = [sys.executable, "-m", "treeverify", "serve"]
    lines = [
        "[Unit]",
        f"Description=treeverify OpenAI-compatible server ({args.name})",
        "After=network-online.target",
        "Wants=network-online.target",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        "ExecStart=" + " ".join(_quote(a) for a in cmd + serve_args),
        f"TimeoutStartSec={args.timeout_start_sec}",
        f"TimeoutStopSec={args.timeout_stop_sec}",
        "KillSignal=SIGTERM",
        "Restart=on-failure",
        f"RestartSec={args.restart_sec}",
    ]
    if args.user:
        lines.append(f"User={args.user}")
    if args.working_directory:
        lines.append(f"WorkingDirectory={args.working_directory}")
    for kv in args.env:
        lines.append(f"Environment={_quote(kv)}")
    lines += ["", "[Install]", "WantedBy=multi-user.target", ""]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    for kv in args.env:
        if "=" not in kv:
            print(f"--env: expected KEY=VALUE, got {kv!r}", file=sys.stderr)
            return 64
    problem = serve_args_problem(_serve_args(args))
    if problem:
        print(f"treeverify unit: serve arguments (after --): {problem}", file=sys.stderr)
        return 64
    sys.stdout.write(render(args))
    return 0
