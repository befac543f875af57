"""Gate parts without a model server: the tolerance rule, exit-code precedence, log signatures,
usage errors (64), the torch-free import, and ``--launch`` lifecycles (crash -> 4, hang -> 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from treeverify.gate import cli, signatures
from treeverify.gate.codes import ExitCode, worst
from treeverify.gate.compare import compare, compare_text

SRC = Path(__file__).resolve().parents[1] / "src"


def _c(tokens, lps, tops):
    return {"tokens": tokens, "text": "".join(tokens), "token_logprobs": lps, "top_logprobs": tops}


REF = _c(
    ["A", "B", "C"],
    [-0.1, -0.5, -0.2],
    [{"A": -0.1, "x": -3.0}, {"B": -0.5, "Q": -0.55, "Z": -2.0}, {"C": -0.2}],
)


def test_identical_passes():
    assert compare(REF, REF).ok and compare(REF, REF).divergence is None


def test_near_tie_swap_is_tolerated_and_rest_ignored():
    cur = _c(["A", "Q", "K"], [-0.1, -0.5], [{"A": -0.1}, {"Q": -0.5, "B": -0.52}, {}])
    out = compare(REF, cur, margin=0.1)
    assert out.ok and out.divergence == 1 and "near-tie" in out.detail


def test_swap_beyond_margin_or_outside_topk_fails():
    far = _c(["A", "Z", "K"], [-0.1, -1.9], [{"A": -0.1}, {"Z": -1.9, "B": -2.0}, {}])
    assert not compare(REF, far, margin=0.1).ok  # in top-k but 1.5 nat below
    odd = _c(["A", "W", "K"], [-0.1, -0.4], [{"A": -0.1}, {"W": -0.4, "B": -0.45}, {}])
    out = compare(REF, odd, margin=0.1)
    assert not out.ok and "not in the reference top-k" in out.detail
    one_sided = _c(["A", "Q", "K"], [-0.1, -0.5], [{"A": -0.1}, {"Q": -0.5}, {}])
    assert not compare(REF, one_sided).ok  # the current side cannot vouch for the swap


def test_logprob_drift_before_divergence_fails():
    cur = _c(["A", "B", "C"], [-0.1, -0.9, -0.2], REF["top_logprobs"])
    out = compare(REF, cur, logprob_atol=0.25)
    assert not out.ok and "drifted" in out.detail and out.divergence == 1


def test_length_difference_fails():
    assert not compare(REF, _c(["A", "B"], [-0.1, -0.5], REF["top_logprobs"][:2])).ok


def test_compare_text_one_sided():
    assert compare_text(REF, "ABC").ok
    assert compare_text(REF, "AQ...", margin=0.1).ok  # Q is a near-tie in the reference
    assert not compare_text(REF, "AZ...", margin=0.1).ok
    assert not compare_text(REF, "AW").ok


def test_compare_text_on_bytes_form_tokens():
    """Partial UTF-8 characters in OpenAI's bytes: form still spell the text, byte by byte."""
    ref = _c(["A", "bytes:\\xc3", "bytes:\\xa9", "B"], [-0.1] * 4, [{}, {}, {}, {}])
    ref["text"] = "A\u00e9B"
    ref["top_logprobs"][3] = {"B": -0.5, "C": -0.52, "D": -3.0}
    ref["token_logprobs"][3] = -0.5
    assert compare_text(ref, "A\u00e9B").ok
    near = compare_text(ref, "A\u00e9C", margin=0.1)
    assert near.ok and near.divergence == 3 and near.other == "C"
    far = compare_text(ref, "A\u00e9D", margin=0.1)
    assert not far.ok and far.kind == "swap" and far.other == "D"
    odd = compare_text(ref, "A\u00e8B")  # the second byte differs: no top-k entry continues
    assert not odd.ok and odd.divergence == 2 and odd.other is None


def test_exit_code_precedence():
    assert worst([]) == ExitCode.PASS
    assert worst([1, 2, 3]) == ExitCode.CORRECTNESS
    assert worst([2, 5]) == ExitCode.HUNG
    assert worst([5, 4, 1]) == ExitCode.UNIT_FAILED


def test_signatures():
    found = signatures.scan(
        [
            "ok",
            "Traceback (most recent call last):",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            "ERROR: CUDA graph capture failed",
            "RuntimeError: CUDA error: device-side assert triggered",
        ]
    )
    names = {f["signature"] for f in found}
    assert {"traceback", "out of memory", "capture failure", "CUDA error"} <= names
    assert signatures.scan(["INFO all good"]) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--bogus"],
        ["--probes", "nope"],
        ["check"],  # needs --golden
        ["record", "--golden", "g.json", "--probes", "smoke"],
        ["--launch", "sleep 1", "--unit", "x"],
        ["--launch", "sleep 1"],  # no --url and no --port in CMD
        ["--timeout", "0"],
        ["--concurrency", "1,x"],
        ["check", "--golden", "/nonexistent/golden.json"],
        ["--context-length", "10"],
        ["--only", "ladder,bogus"],
        ["--samples", "3"],
        ["--false-alarm", "0"],
        ["--ready-timeout", "-1"],
    ],
)
def test_usage_errors_exit_64(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 64
    assert "error" in capsys.readouterr().err


def test_usage_error_as_a_subcommand_exits_64(capsys):
    import argparse

    parser = argparse.ArgumentParser(prog="treeverify")
    cli.add_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["gate", "--bogus"])
    assert exc.value.code == 64
    args = parser.parse_args(["gate", "check", "--golden", "/nonexistent/g.json"])
    assert cli.run(args) == 64


def test_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import treeverify.gate, treeverify.gate.cli, treeverify.gate.runner\n"
        "bad = [m for m in sys.modules if m.startswith(('treeverify.engine', 'treeverify.models',"
        " 'treeverify.server'))]\n"
        "assert not bad, bad\nprint('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def launch_script(tmp_path, source: str) -> tuple[int, str]:
    """Gate a launched script that never serves: (exit code, the readiness verdict's detail)."""
    script = tmp_path / "server.py"
    script.write_text(source)
    j = tmp_path / "r.json"
    rc = cli.main(
        ["--launch", f"{sys.executable} {script}", "--url", "http://127.0.0.1:9"]
        + ["--interval", "0.1", "--timeout", "20", "--quiet", "--json", str(j)]
    )
    return rc, json.loads(j.read_text())["probes"][0]["detail"]


def test_launch_crash_exits_4_with_signature(tmp_path):
    rc, detail = launch_script(
        tmp_path,
        "import sys, time\ntime.sleep(0.3)\nprint('Capturing CUDA graphs')\n"
        "print('RuntimeError: CUDA error: an illegal memory access was encountered', flush=True)\n"
        "sys.exit(3)\n",
    )
    assert rc == 4
    assert "exited with 3" in detail and "illegal memory access" in detail


def test_launch_refusal_shows_the_processes_last_lines(tmp_path):
    """A server that refuses to start with one line on stderr (a missing package, a bad model)
    matches no crash signature; the verdict must still say why, not only the exit status."""
    rc, detail = launch_script(
        tmp_path,
        "import sys\nprint('starting', flush=True)\n"
        "print('treeverify serve: needs fastapi and uvicorn (No module named x)',"
        " file=sys.stderr)\n"
        "sys.exit(2)\n",
    )
    assert rc == 4
    assert "exited with 2" in detail and "needs fastapi and uvicorn" in detail, detail


def test_launch_hang_exits_5_and_is_stopped(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\nprint('loading', flush=True)\ntime.sleep(600)\n")
    j = tmp_path / "r.json"
    rc = cli.main(
        ["--launch", f"{sys.executable} {script} --port 9", "--interval", "0.2"]
        + ["--timeout", "1.5", "--quiet", "--json", str(j)]
    )
    assert rc == 5
    report = json.loads(j.read_text())
    assert "not ready after" in report["probes"][0]["detail"]
    assert report["target"].endswith("http://127.0.0.1:9")


def test_smoke_against_nothing_times_out_5(tmp_path):
    rc = cli.main(
        ["--url", "http://127.0.0.1:9", "--probes", "smoke", "--interval", "0.05"]
        + ["--tries", "3", "--request-timeout", "0.5", "--quiet"]
    )
    assert rc == 5


def test_help_lists_defaults_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    raw = capsys.readouterr().out
    out = " ".join(raw.split())
    assert "(default: 1800.0)" in out and "(default: 256)" in out  # --timeout, --samples
    for code in ("0   pass", "2   correctness", "5   hung", "64  usage"):
        assert code in raw
    for probe in ("sampled", "copy", "chat"):
        assert probe in out


def test_api_key_from_env_reaches_a_launched_server(monkeypatch):
    key = f"k-{os.getpid()}-{id(monkeypatch)}"
    monkeypatch.setenv("TREEVERIFY_API_KEY", key)
    parser = cli.configure(__import__("argparse").ArgumentParser())
    args = parser.parse_args([])
    assert args.api_key == key
    target = cli._target(args)
    assert target.env["TREEVERIFY_API_KEY"] == key
    assert cli._target(parser.parse_args(["--api-key", "other"])).env["TREEVERIFY_API_KEY"] == (
        "other"
    )


def test_api_key_sent_as_bearer(tmp_path):
    from gate_doubles import CopyModel

    key = f"key-{os.getpid()}"
    with CopyModel(api_key=key) as model:
        argv = ["--url", model.url, "--only", "copy", "--quiet", "--timeout", "60"]
        assert cli.main([*argv, "--api-key", key]) == 0
        assert cli.main(argv + ["--api-key", "wrong"]) == 3  # 401: not a verdict on the model


def test_module_main_runs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-m", "treeverify.gate.cli", "--help"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0 and "--golden" in out.stdout and "--unit" in out.stdout


def test_compare_by_token_id():
    """Two tokens shown alike (partial characters) are told apart by their ids; a swap between
    them is judged with the disambiguated top-k keys."""
    ref = _c(
        ["A", "\ufffd"], [-0.1, -1.0], [{"A": -0.1}, {"\ufffd#200": -1.0, "\ufffd#201": -1.04}]
    )
    ref["token_ids"] = [65, 200]
    same_text = dict(ref, token_ids=[65, 201], token_logprobs=[-0.1, -1.04])
    same_text["top_logprobs"] = [{"A": -0.1}, {"\ufffd#201": -1.04, "\ufffd#200": -1.0}]
    out = compare(ref, same_text, margin=0.1)
    assert out.ok and out.divergence == 1 and "id 201" in out.detail
    assert not compare(ref, same_text, margin=0.01).ok
    assert compare(ref, dict(same_text, token_ids=None)).divergence is None  # text alone: equal


def test_g_test_false_alarm_rate_and_power():
    """Counts drawn from the stated probabilities fail at about the stated rate (5% here, so a
    few hundred draws show it); all samples on one token (a sampler gone greedy) fail outright."""
    import numpy as np

    from treeverify.gate.sampled import g_test_pvalue

    rng = np.random.default_rng()
    probs = rng.dirichlet(np.ones(6))
    fails = sum(
        g_test_pvalue(list(rng.multinomial(200, probs)), list(probs), sims=2000) < 0.05
        for _ in range(600)
    )
    # expected ~28 (sd ~5): with its fixed-seed simulations the test rejects 3.5-6% of such
    # draws (by the probs drawn); a correct sampler leaves these bounds in ~1e-8 of runs
    assert 3 <= fails <= 70
    greedy = [0] * 6
    greedy[int(np.argmax(probs))] = 200
    assert g_test_pvalue(greedy, list(probs)) < 1e-4


def test_compare_text_spells_partial_characters_from_bytes_keys():
    """Tokens shown as U+FFFD are spelled from their own top-k entry in OpenAI's bytes: form."""
    ref = _c(["A", "\ufffd", "\ufffd", "B"], [-0.1, -0.2, -0.3, -0.5], [{}] * 4)
    ref["text"] = "A\u00e9B"
    ref["top_logprobs"] = [
        {"A": -0.1},
        {"bytes:\\xc3": -0.2, "bytes:\\xc4": -2.0},
        {"bytes:\\xa9": -0.3},
        {"B": -0.5, "C": -0.52},
    ]
    assert compare_text(ref, "A\u00e9C", margin=0.1).ok
    assert not compare_text(ref, "A\u00e8B").ok


def test_concurrency_sizes_from_server_info():
    """Our server lists (batch, tokens) graph buckets: every batch size and the one past it, up to
    the largest + 1 (within max running requests); without /server_info, --max-concurrency."""
    from treeverify.gate.probes import concurrency_sizes, concurrency_top
    from treeverify.gate.probing import Ctx

    buckets = [[b, n] for n in (1, 9) for b in (1, 2, 4, 8, 16, 24)]
    info = {"cuda_graph": {"buckets": buckets}, "server_args": {"max_running_requests": 64}}
    ctx = Ctx(None, None, 0.1, 0.25, 30, server_info=info)
    assert concurrency_top(ctx)[0] == 25
    assert concurrency_sizes(ctx) == [1, 2, 3, 4, 5, 8, 9, 13, 16, 17, 24, 25]
    ctx.server_info = {"server_args": {"max_running_requests": 20}}
    assert concurrency_sizes(ctx) == [1, 3, 8, 13, 17, 20]
    ctx.server_info, ctx.max_concurrency = None, 12
    assert concurrency_sizes(ctx) == [1, 3, 8, 12]


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--serve-args", '--speculative-algorithm "DDTREE'], "--serve-args"),
        (["--launch", 'echo "x', "--url", "http://127.0.0.1:9"], "--launch"),
        (["--url", "http://127.0.0.1:99999"], "--url"),
        (["--url", "127.0.0.1:30000"], "--url"),  # no scheme
        (["--baseline-url", "http://127.0.0.1:70000"], "--baseline-url"),
        (["--margin", "-0.1"], "--margin"),
        (["--logprob-atol", "-1"], "--logprob-atol"),
        (["--perf-factor", "-3"], "--perf-factor"),
        (["--perf-factor", "nan"], "--perf-factor"),
        (["--timeout", "nan"], "--timeout"),
        (["--only", ""], "--only"),
        (["--json", "/nonexistent/dir/x.json"], "--json"),
        (["--junit", "."], "--junit"),  # a directory
        (["record", "--golden", "/nonexistent/dir/g.json"], "--golden"),
        (["--oracle-out", "/nonexistent/dir/o.json"], "--oracle-out"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_flag(argv, flag, capsys):
    """Each fails with 64 before anything is launched or polled, one line naming the flag."""
    try:
        rc = cli.main([*argv, "--timeout", "5"] if "--timeout" not in argv else argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 64
    out = capsys.readouterr()
    assert flag in out.err.strip().splitlines()[-1] and "Traceback" not in out.err
    assert out.out == ""


def test_quiet_still_prints_failures_and_the_verdict(capsys):
    rc = cli.main(
        ["--url", "http://127.0.0.1:9", "--probes", "smoke", "--interval", "0.05"]
        + ["--tries", "2", "--request-timeout", "0.5", "--quiet"]
    )
    assert rc == 5
    lines = capsys.readouterr().out.splitlines()
    assert lines == [lines[0], "GATE FAIL: exit 5 (HUNG)"] and lines[0].startswith("smoke: FAIL(5)")


def test_report_write_failure_keeps_the_verdict(monkeypatch, tmp_path, capsys):
    """A report that cannot be written after the run (disk full) is said, and the exit code is
    still the verdict's, not a traceback's 1."""

    def full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli.Report, "write_json", full)
    rc = cli.main(
        ["--url", "http://127.0.0.1:9", "--probes", "smoke", "--interval", "0.05"]
        + ["--tries", "2", "--request-timeout", "0.5", "--quiet", "--json", str(tmp_path / "r")]
    )
    assert rc == 5
    assert "--json: cannot write" in capsys.readouterr().err


def test_an_empty_api_key_is_a_usage_error(monkeypatch, capsys):
    """An empty --api-key or a blank TREEVERIFY_API_KEY would check (or launch) a server with
    no key at all: a usage error naming them."""
    parser = cli.configure(__import__("argparse").ArgumentParser())
    monkeypatch.delenv("TREEVERIFY_API_KEY", raising=False)
    assert cli.run(parser.parse_args(["--api-key", ""])) == 64
    monkeypatch.setenv("TREEVERIFY_API_KEY", " ")
    assert cli.run(cli.configure(__import__("argparse").ArgumentParser()).parse_args([])) == 64
    assert "TREEVERIFY_API_KEY: empty" in capsys.readouterr().err
