"""``treeverify gate [run|record|check]``: the deployment gate's command line.

Targets: ``--url URL`` (HTTP only), ``--launch CMD`` (a process it starts and watches), ``--unit
NAME`` (systemd), or none: it launches ``treeverify serve --model tiny-code`` on a free port
(``--serve-args`` adds flags), gates it and stops it. Exit codes: 0 pass, 1 performance
regression, 2 correctness failure, 3 gate/infrastructure error, 4 unit failed / crash-looping /
launched process died, 5 hung or timed out, 64 usage error.
Also runnable alone: ``python -m treeverify.gate.cli [run|record|check] ...``.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import socket
import sys
import urllib.parse

from treeverify import env
from treeverify.gate import golden as G
from treeverify.gate import probes, runner, smoke, targets
from treeverify.gate.codes import ExitCode
from treeverify.gate.compare import DEFAULT_LOGPROB_ATOL, DEFAULT_MARGIN
from treeverify.gate.report import ProbeResult, Report
from treeverify.strict_args import output_file, output_file_problem, own_unknown_flags

EXIT_CODES = """exit codes:
  0   pass
  1   performance regression (latency beyond --perf-factor x golden + --perf-slack)
  2   correctness failure (a probe's outputs are wrong)
  3   gate/infrastructure error (inconclusive)
  4   unit failed / crash-looping / launched process died
  5   hung or timed out (not ready in time, a stalled stream, --timeout spent)
  64  usage error
"""
PROBE_NAMES = tuple(name for name, _ in probes.FULL)


class _Help(argparse.RawDescriptionHelpFormatter):
    """Each flag's default after its help (unless the help already says it, or there is none);
    the description and the exit codes kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        d = action.default
        if "default" in text or d in (None, "", False) or d is argparse.SUPPRESS:
            return text
        return f"{text} (default: {d})".strip()


class UsageError(Exception):
    pass


def _usage_exit(parser: argparse.ArgumentParser):
    def error(message: str):
        parser.print_usage(sys.stderr)
        parser.exit(int(ExitCode.USAGE), f"{parser.prog}: error: {message}\n")

    return error


def configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.formatter_class = _Help
    p.epilog = EXIT_CODES
    p.error = _usage_exit(p)
    own_unknown_flags(p)  # the gate's usage error, exit 64
    p.add_argument(
        "action",
        nargs="?",
        choices=("run", "record", "check"),
        default="run",
        help="run: the gate (default); record: write a golden file from a known-good "
        "deployment; check: the gate against --golden (required)",
    )
    t = p.add_argument_group("target (default: launch treeverify serve on tiny-code)")
    t.add_argument("--url", help="the service's base URL (with --unit: default :30000)")
    t.add_argument("--launch", metavar="CMD", help="start CMD, watch it, scan its output")
    t.add_argument("--unit", metavar="NAME", help="systemd unit to watch (systemctl/journalctl)")
    t.add_argument("--serve-args", default="", help="extra flags for the default launch")
    t.add_argument("--model", help="model name for requests (default: the first /v1/models)")
    t.add_argument(
        "--api-key",
        # $TREEVERIFY_API_KEY ("" when set but blank: run() refuses it, as an empty --api-key)
        default=env.api_key_as_set(),
        help="sent as 'Authorization: Bearer KEY' on every request and given to a server the "
        "gate launches (default: $TREEVERIFY_API_KEY)",
    )
    r = p.add_argument_group("readiness and timeouts")
    r.add_argument(
        "--probes",
        choices=("full", "smoke"),
        default="full",
        help="full: readiness + every probe; smoke: the seed's polling loop, for comparison",
    )
    r.add_argument(
        "--only",
        metavar="NAMES",
        help=f"run only these probes (comma-separated: {','.join(PROBE_NAMES)})",
    )
    r.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="hard cap on the whole run (s): every request waits at most what is left; "
        "spent -> exit 5",
    )
    r.add_argument("--ready-timeout", type=float, default=900.0, help="budget to become ready (s)")
    r.add_argument(
        "--interval", type=float, help="seconds between polls (full: 2; smoke: the seed's 30)"
    )
    r.add_argument("--tries", type=int, default=smoke.TRIES, help="smoke: polls before giving up")
    r.add_argument(
        "--request-timeout", type=float, default=smoke.REQUEST_TIMEOUT, help="smoke: per request"
    )
    r.add_argument("--connect-timeout", type=float, default=5.0, help="per connection (s)")
    r.add_argument(
        "--read-timeout", type=float, default=60.0, help="per request, within --timeout (s)"
    )
    r.add_argument(
        "--itl-deadline", type=float, default=30.0, help="max wait for any streamed token (s)"
    )
    q = p.add_argument_group("probes")
    q.add_argument("--golden", metavar="FILE", help="golden file (record writes it)")
    q.add_argument("--oracle", metavar="FILE", help="JSON list of {prompt|messages, expected}")
    q.add_argument("--oracle-out", metavar="FILE", help="record: also write an oracle file")
    q.add_argument("--context-length", type=int, help="default: /v1/models max_model_len")
    q.add_argument(
        "--concurrency", help="sizes, e.g. 1,3,8,13 (default: 1,3,8,13,17, graph buckets +-1, top)"
    )
    q.add_argument(
        "--max-concurrency",
        type=int,
        help="largest concurrency (default: our server's largest graph bucket + 1 or max "
        "running requests, from /server_info; 32 for other servers)",
    )
    q.add_argument("--baseline-url", help="reference server for speculation on vs off")
    q.add_argument(
        "--margin",
        type=float,
        help=f"near-tie margin (nat): a swap of two tokens whose teacher-forced logprobs differ "
        f"by at most this is tolerated (default: the golden file's, else {DEFAULT_MARGIN})",
    )
    q.add_argument(
        "--logprob-atol",
        type=float,
        help=f"max logprob drift before a divergence (default: the golden file's, else "
        f"{DEFAULT_LOGPROB_ATOL})",
    )
    q.add_argument(
        "--samples", type=int, default=256, help="sampled probe: first tokens drawn at T=1"
    )
    q.add_argument(
        "--false-alarm",
        type=float,
        default=1e-4,
        help="sampled probe: the frequency test's false-alarm rate",
    )
    q.add_argument("--perf-factor", type=float, default=3.0, help="latency regression factor")
    q.add_argument("--perf-slack", type=float, default=0.05, help="latency slack (s)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="FILE", type=output_file, help="write the JSON report here")
    o.add_argument(
        "--junit", metavar="FILE", type=output_file, help="write a JUnit XML report here"
    )
    o.add_argument(
        "--quiet",
        action="store_true",
        help="no live timeline or table: only each failed probe's line and the verdict line",
    )
    return p


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "gate",
        help="deployment gate: readiness + probes that catch what a smoke test misses",
        description=__doc__.split("\n\n")[0],
    )
    return configure(p)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_url(flag: str, url: str) -> None:
    """A malformed URL is a usage error now, not a server that never became ready."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError as exc:
        raise UsageError(f"{flag}: {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{flag}: {url!r}: expected http(s)://HOST[:PORT]")


def _split(flag: str, value: str) -> list[str]:
    try:
        return shlex.split(value)
    except ValueError as exc:  # an unbalanced quote
        raise UsageError(f"{flag}: {exc}: {value!r}") from None


def _options(a: argparse.Namespace) -> runner.Options:
    if a.launch and a.unit:
        raise UsageError("--launch and --unit are exclusive")
    if a.action in ("record", "check") and not a.golden:
        raise UsageError(f"gate {a.action} needs --golden FILE")
    if a.action == "record" and a.probes == "smoke":
        raise UsageError("gate record records the full suite; --probes smoke makes no sense")
    seconds = ("timeout", "ready_timeout", "interval", "request_timeout")
    for name in (*seconds, "connect_timeout", "read_timeout", "itl_deadline"):
        v = getattr(a, name)
        if v is not None and not v > 0:  # nan too
            raise UsageError(f"--{name.replace('_', '-')} must be > 0")
    if a.tries < 1 or (a.max_concurrency is not None and a.max_concurrency < 1):
        raise UsageError("--tries and --max-concurrency must be >= 1")
    if a.samples < 16:
        raise UsageError("--samples must be >= 16")
    if not 0 < a.false_alarm < 0.5:
        raise UsageError("--false-alarm must be in (0, 0.5)")
    for name in ("margin", "logprob_atol", "perf_slack"):
        v = getattr(a, name)
        if v is not None and not (math.isfinite(v) and v >= 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number >= 0")
    if not (math.isfinite(a.perf_factor) and a.perf_factor > 0):
        raise UsageError("--perf-factor must be a finite number > 0")
    for flag, url in (("--url", a.url), ("--baseline-url", a.baseline_url)):
        if url is not None:
            _check_url(flag, url)
    writes = [("--oracle-out", a.oracle_out)]
    if a.action == "record":
        writes.append(("--golden", a.golden))
    for flag, path in writes:  # record's files: fail before the run, not after it
        problem = path is not None and output_file_problem(path)
        if problem:
            raise UsageError(f"{flag}: {problem}")
    only = None
    if a.only is not None:  # --only "" would otherwise run every probe
        only = [x.strip() for x in a.only.split(",") if x.strip()]
        unknown = [x for x in only if x not in PROBE_NAMES]
        if not only:
            raise UsageError(f"--only: no probe named; known: {', '.join(PROBE_NAMES)}")
        if unknown:
            raise UsageError(f"--only: unknown probe(s) {unknown}; known: {', '.join(PROBE_NAMES)}")
    if a.context_length is not None and a.context_length < 64:
        raise UsageError("--context-length must be >= 64")
    conc = None
    if a.concurrency:
        try:
            conc = sorted({int(x) for x in a.concurrency.split(",") if x.strip()})
        except ValueError:
            raise UsageError(f"--concurrency: not a list of integers: {a.concurrency!r}") from None
        if not conc or conc[0] < 1:
            raise UsageError("--concurrency sizes must be >= 1")
    gold = oracle = None
    try:
        if a.golden and a.action != "record":
            gold = G.load(a.golden)
        if a.oracle:
            oracle = G.load_oracle(a.oracle)
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    interval = (
        a.interval if a.interval is not None else (smoke.INTERVAL if a.probes == "smoke" else 2.0)
    )
    return runner.Options(
        action=a.action,
        probes=a.probes,
        model=a.model,
        timeout=a.timeout,
        ready_timeout=a.ready_timeout,
        only=only,
        interval=interval,
        tries=a.tries,
        request_timeout=a.request_timeout,
        connect_timeout=a.connect_timeout,
        read_timeout=a.read_timeout,
        itl_deadline=a.itl_deadline,
        golden=gold,
        golden_path=a.golden,
        oracle=oracle,
        oracle_out=a.oracle_out,
        context_length=a.context_length,
        concurrency=conc,
        max_concurrency=a.max_concurrency,
        baseline_url=a.baseline_url,
        margin=a.margin,
        logprob_atol=a.logprob_atol,
        perf_factor=a.perf_factor,
        perf_slack=a.perf_slack,
        api_key=a.api_key,
        samples=a.samples,
        false_alarm=a.false_alarm,
    )


def _target(a: argparse.Namespace):
    if a.unit:
        return targets.UnitTarget(a.unit, a.url or "http://127.0.0.1:30000")
    if a.launch:
        argv = _split("--launch", a.launch)
        if not argv:
            raise UsageError("--launch: empty command")
        url = a.url
        if url is None:
            m = re.search(r"--port[= ](\d+)", a.launch)
            if not m:
                raise UsageError("--launch: give --url (or a --port N in CMD)")
            url = f"http://127.0.0.1:{m.group(1)}"
        return targets.LaunchTarget(argv, url, env=_child_env(a))
    if a.url:
        return targets.UrlTarget(a.url)
    port = _free_port()
    argv = targets.serve_argv(port, _split("--serve-args", a.serve_args))
    return targets.LaunchTarget(argv, f"http://127.0.0.1:{port}", env=_child_env(a))


def _child_env(a: argparse.Namespace) -> dict | None:
    """A launched server's environment: ours, plus the API key it must demand (if any)."""
    return {**os.environ, "TREEVERIFY_API_KEY": a.api_key} if a.api_key else None


def run(args: argparse.Namespace) -> int:
    try:
        if args.api_key is not None and not args.api_key.strip():  # auth off by an empty value
            raise UsageError("--api-key / TREEVERIFY_API_KEY: empty; unset it to check a server "
                             "without a key")  # fmt: skip
        opts = _options(args)
        target = _target(args)
    except UsageError as exc:
        print(f"treeverify gate: error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    report = Report(quiet=args.quiet)
    try:
        runner.run(target, opts, report)
    except KeyboardInterrupt:
        print("treeverify gate: interrupted", file=sys.stderr)
        return int(ExitCode.INFRA)
    except Exception as exc:  # a bug or an unexpected environment: infrastructure, not a verdict
        print(f"treeverify gate: internal error: {exc!r}", file=sys.stderr)
        report.add(ProbeResult("gate", "fail", f"internal error: {exc!r}", ExitCode.INFRA))
    table = report.table()
    if args.quiet:  # the failures and the verdict still: a silent gate explains nothing
        failed = [r for r in report.results if r.verdict == "fail"]
        lines = [f"{r.name}: FAIL({int(r.code)}) {r.detail[:200]}".rstrip() for r in failed]
        table = "\n".join([*lines, table.splitlines()[-1]])
    print(table, flush=True)
    code = report.exit_code()
    for flag, path, write in (("--json", args.json, report.write_json),
                              ("--junit", args.junit, report.write_junit)):  # fmt: skip
        if path:
            try:
                write(path)
            except OSError as exc:  # checked up front: a full disk or a race; keep the verdict
                print(f"treeverify gate: {flag}: cannot write {path}: {exc}", file=sys.stderr)
                code = code or ExitCode.INFRA
    return int(code)


def main(argv: list[str] | None = None) -> int:
    parser = configure(argparse.ArgumentParser(prog="treeverify gate", description=__doc__))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
