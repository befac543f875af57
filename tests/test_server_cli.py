"""`treeverify unit`, the serve flags, and bench serve's statistics (no server needed)."""

from __future__ import annotations

import argparse

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


def test_serve_rejects_bad_values(capsys):
    assert cli.run(_parse(cli, ["serve", "--num-pages", "0"])) == 64
    assert "--num-pages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(cli, ["serve", "--attention-backend", "flash"])
    assert cli.run(_parse(cli, ["serve", "--mem-fraction-static", "1.2"])) == 64
    assert "--mem-fraction-static" in capsys.readouterr().err
    assert cli.run(_parse(cli, ["serve", "--cuda-graph-max-bs", "0"])) == 64
    assert "--cuda-graph-max-bs" in capsys.readouterr().err
    chain = ["serve", "--speculative-algorithm", "CHAIN", "--speculative-adaptive"]
    assert cli.run(_parse(cli, chain)) == 64
    assert "--speculative-adaptive" in capsys.readouterr().err


def test_serve_gpu_flag_defaults():
    args = _parse(cli, ["serve"])
    assert args.mem_fraction_static == 0.88 and not args.disable_cuda_graph
    assert args.cuda_graph_max_bs is None and args.num_pages is None  # sized on the GPU
    assert args.attention_backend == "auto" and args.speculative_draft_model_path == "ngram"
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
