"""`treeverify unit`, the serve flags, and bench serve's statistics (no server needed)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from treeverify.server import bench_serve, cli, unit


def _parse(module, argv):
    p = argparse.ArgumentParser()
    module.add_parser(p.add_subparsers(dest="command")).set_defaults(run=module.run)
    return p.parse_args(argv)


def test_unit_prints_a_notify_unit(capsys):
    args = _parse(
        unit,
        [
            "unit",
            "--exec",
            "/opt/tv/bin/treeverify",
            "--env",
            "A=b c",
            "--",
            "--model",
            "/models/My Model",
            "--port",
            "30000",
        ],
    )
    assert unit.run(args) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "Type=notify" in lines and "Restart=on-failure" in lines
    assert "TimeoutStartSec=1800" in lines and any(x.startswith("RestartSec=") for x in lines)
    exec_line = next(x for x in lines if x.startswith("ExecStart="))
    assert exec_line == (
        'ExecStart=/opt/tv/bin/treeverify serve --model "/models/My Model" --port 30000'
    )
    assert 'Environment="A=b c"' in lines
    assert "[Install]" in lines and "WantedBy=multi-user.target" in lines


def test_unit_rejects_bad_env(capsys):
    assert unit.run(_parse(unit, ["unit", "--env", "NOEQUALS"])) == 64


def test_serve_accepts_sglang_flags():
    args = _parse(
        cli,
        [
            "serve",
            "--model",
            "tiny-kimi",
            "--mem-fraction-static",
            "0.85",
            "--disable-cuda-graph",
            "--cuda-graph-max-bs",
            "160",
            "--attention-backend",
            "triton",
            "--context-length",
            "8192",
            "--served-model-name",
            "kimi",
            "--max-running-requests",
            "8",
            "--chunked-prefill-size",
            "512",
            "--num-pages",
            "64",
            "--page-size",
            "32",
        ],
    )
    assert args.mem_fraction_static == 0.85 and args.disable_cuda_graph
    assert args.cuda_graph_max_bs == 160 and args.attention_backend == "triton"
    assert (args.num_pages, args.page_size, args.served_model_name) == (64, 32, "kimi")


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--num-pages", "0"], "--num-pages"),
        (["--attention-backend", "flash"], "--attention-backend"),
        (["--mem-fraction-static", "1.2"], "--mem-fraction-static"),
        (["--cuda-graph-max-bs", "0"], "--cuda-graph-max-bs"),
        (["--log-level", "loud"], "--log-level"),
        (["--dtype", "int8"], "--dtype"),
        (["--max-request-bytes", "0"], "--max-request-bytes"),
        (["--port", "70000"], "--port"),  # was an OverflowError traceback after the model loaded
        (["--speculative-ddtree-budget", "5000"], "--speculative-ddtree-budget"),  # (after load)
        (["--speculative-num-draft-tokens", "-3"], "--speculative-num-draft-tokens"),
    ],
)
def test_serve_rejects_bad_values(capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        _parse(cli, ["serve", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and " serve [-h]" in err  # serve's usage, not the top level's


def test_an_empty_api_key_is_refused_not_auth_off(capsys, monkeypatch):
    """--api-key "" (or a blank TREEVERIFY_API_KEY: a secret that failed to render) turned
    authentication off, said only at INFO; now exit 2 naming it, before the model loads."""
    monkeypatch.delenv("TREEVERIFY_API_KEY", raising=False)
    assert cli.run(_parse(cli, ["serve", "--api-key", " "])) == 2
    assert "--api-key: empty" in capsys.readouterr().err
    monkeypatch.setenv("TREEVERIFY_API_KEY", "  ")
    assert cli.run(_parse(cli, ["serve"])) == 2
    assert "TREEVERIFY_API_KEY: set but empty" in capsys.readouterr().err


def test_serve_adaptive_needs_ddtree(capsys):
    chain = ["serve", "--speculative-algorithm", "CHAIN", "--speculative-adaptive"]
    assert cli.run(_parse(cli, chain)) == 2
    assert "--speculative-adaptive" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--speculative-controller", "nope=1"], "nope=1"),
        (["--speculative-controller", "plain_margin=lots"], "plain_margin"),
        (["--speculative-controller", "plain_halflife=0"], "plain_halflife"),
        (["--speculative-controller", "new_batch_at_once=maybe"], "new_batch_at_once"),
        (["--speculative-controller", "explore_far_factor=nan"], "explore_far_factor"),
        (["--no-speculative-adaptive", "--speculative-controller", "plain_margin=1"],
         "adaptive"),
    ],
)  # fmt: skip
def test_serve_controller_knobs_are_checked_before_the_model_loads(capsys, extra, says):
    argv = ["serve", "--speculative-algorithm", "DDTREE", *extra]
    assert cli.run(_parse(cli, argv)) == 2
    err = capsys.readouterr().err
    assert "--speculative-controller" in err and says in err


def test_serve_controller_knobs_reach_the_engine():
    """--speculative-controller KNOB=VALUE (repeatable) -> EngineConfig.speculative_controller
    -> the controller's config (shown in /server_info: tests/test_server_speculative.py)."""
    from treeverify.engine.llm import LLM

    args = _parse(cli, ["serve", "--speculative-controller", "plain_margin=0.05",
                        "--speculative-controller", "min_dwell=4"])  # fmt: skip
    assert args.speculative_controller == ["plain_margin=0.05", "min_dwell=4"]
    llm = LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_ddtree_budget=8,
              speculative_controller=tuple(args.speculative_controller),
              speculative_cost_seconds={0: 1.0, 4: 1.5, 8: 1.6})  # fmt: skip
    cfg = llm.controller.cfg
    assert cfg.plain_margin == 0.05 and cfg.min_dwell == 4 and cfg.plain_halflife == 16.0
    assert llm.controller.info()["config"]["min_dwell"] == 4
    with pytest.raises(ValueError, match="speculative_controller: .*decay"):
        LLM("tiny-llama", speculative_algorithm="DDTREE", speculative_controller=("decay=2",))


def test_serve_gpu_flag_defaults():
    args = _parse(cli, ["serve"])
    assert args.mem_fraction_static == 0.88 and not args.disable_cuda_graph
    assert args.cuda_graph_max_bs is None and args.num_pages is None  # sized on the GPU
    assert args.attention_backend == "auto" and args.speculative_draft_model_path is None
    assert args.speculative_adaptive is None  # on for DDTREE
    assert _parse(cli, ["serve", "--no-speculative-adaptive"]).speculative_adaptive is False


def test_percentiles():
    xs = [float(i) for i in range(1, 101)]
    assert bench_serve.percentile(xs, 50) == pytest.approx(50.5)
    assert bench_serve.percentile(xs, 99) == pytest.approx(99.01)
    assert bench_serve.percentile([], 50) is None
    s = bench_serve.summarize([1.0, 3.0])
    assert s["p50"] == 2.0 and s["mean"] == 2.0


def test_bench_serve_reports_unreachable_server(capsys):
    args = _parse(bench_serve, ["serve", "--url", "http://127.0.0.1:9", "--quiet"])
    assert bench_serve.run(args) == 3


@pytest.mark.parametrize(
    "argv, flag",
    [(["--concurrency", "0"], "--concurrency"), (["--num-requests", "0"], "--num-requests"),
     (["--temperature", "-5"], "--temperature"), (["--timeout", "-1"], "--timeout")],
)  # fmt: skip
def test_bench_serve_names_the_bad_flag_before_sending(capsys, argv, flag):
    """One message for three flags named none of them, and a bad temperature or timeout ran
    the benchmark to "1 fail" with no reason: each flag named with its value, up front."""
    args = _parse(bench_serve, ["serve", "--url", "http://127.0.0.1:9", "--quiet", *argv])
    assert bench_serve.run(args) == 64
    assert flag in capsys.readouterr().err


def _serve_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The real ``treeverify serve`` command line in a subprocess (no server is started)."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    full_env = {**os.environ, "PYTHONPATH": src, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "treeverify", "serve", *argv],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )


@pytest.mark.parametrize(
    "argv, flag", [(["--page-size", "-3"], "--page-size"), (["--bogus-flag"], "--bogus-flag")]
)
def test_serve_usage_errors_show_serve_usage_and_exit_2(argv, flag):
    r = _serve_cli(*argv)
    assert r.returncode == 2
    assert "usage: treeverify serve" in r.stderr and flag in r.stderr
    assert "Traceback" not in r.stderr


def test_tensor_parallel_flags():
    args = _parse(cli, ["serve", "--tp-size", "1"])
    assert args.tp_size == 1 and _parse(cli, ["serve", "--tp", "1"]).tp_size == 1
    r = _serve_cli("--tp", "2")
    assert r.returncode == 2 and "SGLang" in r.stderr and "usage: treeverify serve" in r.stderr


def test_dtype_and_trust_remote_code_flags():
    args = _parse(cli, ["serve", "--dtype", "bfloat16", "--trust-remote-code"])
    assert args.dtype == "bfloat16" and args.trust_remote_code
    assert _parse(cli, ["serve"]).dtype == "auto"


def test_help_shows_defaults():
    r = _serve_cli("--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "(default: 30000)" in text and "(default: 0.88)" in text
    assert f"(default: {8 * 1024 * 1024})" in text and "TREEVERIFY_API_KEY" in text


def test_missing_model_directory_is_one_line_exit_2(tmp_path):
    missing = tmp_path / "no" / "such-model"
    r = _serve_cli("--model", str(missing))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and str(missing) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_uncached_hub_id_is_one_line_exit_2(tmp_path):
    r = _serve_cli(
        "--model",
        f"treeverify-tests/absent-{os.getpid()}",
        env={"HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"},
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "local Hugging Face cache" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_directory_without_config_is_one_line_exit_2(tmp_path):
    r = _serve_cli("--model", str(tmp_path))
    assert r.returncode == 2 and "config.json" in r.stderr and "Traceback" not in r.stderr


def test_unreadable_chat_template_is_one_line_exit_2(tmp_path):
    r = _serve_cli("--chat-template", str(tmp_path / "absent.jinja"))
    assert r.returncode == 2 and "--chat-template" in r.stderr and "Traceback" not in r.stderr


def test_broken_model_directory_is_one_error_line_exit_2(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    r = _serve_cli("--model", str(tmp_path), "--port", "0")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "hidden_size" in r.stderr
    errors = [x for x in r.stderr.splitlines() if " ERROR " in x]
    assert len(errors) == 1 and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z ERROR", errors[0])


def test_engine_switches_reach_the_engine_config():
    """serve's engine switches land in the LLM's config: the server builds a real (CPU) engine."""
    from treeverify.server.main import build_engine

    base = ["serve", "--model", "tiny-llama", "--device", "cpu", "--num-pages", "32"]
    argv = [*base, "--disable-prefill-graphs", "--disable-round-graphs",
            "--disable-round-lookahead"]  # fmt: skip
    llm, _ = build_engine(_parse(cli, argv))
    cfg = llm.config
    assert cfg.disable_prefill_graphs and cfg.prefill_graph_sizes == ()
    assert cfg.disable_round_graphs and cfg.round_lookahead is False
    default, _ = build_engine(_parse(cli, base))
    assert not default.config.disable_prefill_graphs and default.config.round_lookahead is None
    assert default.config.prefill_graph_sizes == (32, 64, 128, 256, 512)  # used on a GPU


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--uvicorn-log-level", "bogus"], "--uvicorn-log-level"),
        (["--health-heartbeat-timeout", "-1"], "--health-heartbeat-timeout"),
        (["--health-heartbeat-timeout", "inf"], "--health-heartbeat-timeout"),
        (["--health-generate-timeout", "nan"], "--health-generate-timeout"),
        (["--health-generate-timeout", "0"], "--health-generate-timeout"),
        (["--shutdown-grace", "-5"], "--shutdown-grace"),
    ],
)
def test_serve_rejects_bad_levels_and_seconds(capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        _parse(cli, ["serve", *argv])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


def test_serve_levels_and_seconds_accepted():
    args = _parse(cli, ["serve", "--uvicorn-log-level", "INFO", "--shutdown-grace", "0",
                        "--health-generate-timeout", "2.5"])  # fmt: skip
    assert args.uvicorn_log_level == "info"  # uvicorn's key
    assert (args.shutdown_grace, args.health_generate_timeout) == (0.0, 2.5)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--name", "x\nExecStartPre=/bin/rm -rf /tmp/zz"], "--name"),
        (["--name", "my server"], "--name"),
        (["--timeout-start-sec", "-5"], "--timeout-start-sec"),
        (["--timeout-stop-sec", "-1"], "--timeout-stop-sec"),
        (["--restart-sec", "-1"], "--restart-sec"),
        (["--working-directory", "/srv\nUser=root"], "--working-directory"),
        (["--working-directory", "relative/dir"], "--working-directory"),  # systemd refuses it
        (["--exec", "/bin/tv\rx"], "--exec"),
        (["--user", "tv\nGroup=root"], "--user"),
        (["--env", "A=1\nExecStartPre=/bin/true"], "--env"),
    ],
)
def test_unit_rejects_values_that_break_the_unit(capsys, argv, flag):
    with pytest.raises(SystemExit) as exc:
        _parse(unit, ["unit", *argv])
    assert exc.value.code == 2 and flag in capsys.readouterr().err


@pytest.mark.parametrize(
    "serve_args, says",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--page-size", "-3"], "--page-size"),
        (["--model", "a\nExecStartPre=/bin/true"], "control characters"),
        (["--help"], "--help"),
    ],
)
def test_unit_checks_serve_args_with_serves_parser(capsys, serve_args, says):
    assert unit.run(_parse(unit, ["unit", "--", *serve_args])) == 64
    out = capsys.readouterr()
    assert out.out == "" and says in out.err and len(out.err.strip().splitlines()) == 1


def test_unit_name_with_safe_characters():
    args = _parse(unit, ["unit", "--name", "kimi-k2_tp8@gpu0.v2", "--", "--port", "30001"])
    assert "(kimi-k2_tp8@gpu0.v2)" in unit.render(args)
