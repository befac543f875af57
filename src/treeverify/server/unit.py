"""``treeverify unit``: print a systemd unit that runs ``treeverify serve`` (Type=notify).

    treeverify unit -- --model /models/Kimi-K2 --port 30000 > treeverify.service

The server sends READY=1 only once it answers requests, so ``TimeoutStartSec`` must cover
loading the largest model (default 1800 s); ``Restart=on-failure`` with ``RestartSec`` restarts a
crashed server (a crash loop shows as ``activating (auto-restart)`` with a growing NRestarts).
"""

from __future__ import annotations

import argparse
import shutil
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("unit", help="print a systemd unit (Type=notify) for the server")
    p.add_argument("--name", default="treeverify", help="Description= suffix")
    p.add_argument(
        "--exec",
        dest="executable",
        help="the treeverify executable (default: found on PATH, else python -m)",
    )
    p.add_argument("--user", help="User= to run as")
    p.add_argument("--working-directory", help="WorkingDirectory=")
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="Environment= (repeatable)"
    )
    p.add_argument(
        "--timeout-start-sec",
        type=int,
        default=1800,
        help="TimeoutStartSec (model load + warmup must fit)",
    )
    p.add_argument("--timeout-stop-sec", type=int, default=60)
    p.add_argument("--restart-sec", type=int, default=10)
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


def render(args: argparse.Namespace) -> str:
    serve_args = list(args.serve_args or [])
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
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
    sys.stdout.write(render(args))
    return 0
