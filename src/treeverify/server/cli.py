"""``treeverify serve``: flags in SGLang's spelling (``--mem-fraction-static``, ...).

GPU-only flags (--mem-fraction-static, --cuda-graph-max-bs, --disable-cuda-graph) are accepted on
the CPU too and have no effect there (the CPU engine is eager, with --num-pages pages); every flag
is recorded in /server_info so a deployment can pass SGLang-style arguments unchanged.
Also runnable alone: ``python -m treeverify.server.cli serve --model tiny-llama --port 30000``.
"""

from __future__ import annotations

import argparse
import logging
import sys


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    p.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default="tiny-llama",
        help="tiny-llama, tiny-kimi, smollm2-135m (extra: smollm2), or a local Hugging Face "
        "directory",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", help="model id clients use (default: --model)")
    p.add_argument("--context-length", type=int, help="max prompt + output tokens per request")
    p.add_argument(
        "--attention-backend",
        choices=("auto", "torch", "triton", "cuda"),
        default="auto",
        help="auto: cuda on a GPU, torch on the CPU",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument(
        "--num-pages",
        type=int,
        help="KV pages in the pool (default: from --mem-fraction-static on a GPU, 512 on CPU)",
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.88,
        help="GPU: fraction of device memory for weights + KV pool, measured after load "
        "(the rest is for activations and graphs)",
    )
    p.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="GPU: run every step eagerly (no CUDA-graph capture)",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        help="GPU: largest decode batch captured (default min(--max-running-requests, 32))",
    )
    p.add_argument(
        "--speculative-algorithm",
        choices=("DDTREE", "CHAIN"),
        help='speculative decoding (per-request opt-out: "speculative": false)',
    )
    p.add_argument(
        "--speculative-ddtree-budget",
        type=int,
        default=16,
        help="tree nodes besides the root (up to 1024)",
    )
    p.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="DDTREE: choose each step's tree budget (0 = plain decoding, powers of two up to "
        "--speculative-ddtree-budget) from measured acceptance and the step cost measured at "
        "startup (default: on for DDTREE; docs/ddtree.md)",
    )
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=4,
        help="draft depth L (positions proposed per round)",
    )
    p.add_argument(
        "--speculative-draft-model-path",
        default="ngram",
        help="the drafter: 'ngram' (weight-free), a DFlash drafter directory (published "
        "format), or 'tiny-dflash' (seeded, for tiny-llama tests)",
    )
    p.add_argument(
        "--default-max-tokens", type=int, default=16, help="max_tokens when a request leaves it out"
    )
    p.add_argument(
        "--health-heartbeat-timeout",
        type=float,
        default=10.0,
        help="/health is 503 once the engine loop is silent this long (s)",
    )
    p.add_argument(
        "--health-generate-timeout",
        type=float,
        default=10.0,
        help="/health_generate is 503 if its 1-token request takes longer (s)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds in-flight requests may finish before 'abort'",
    )
    p.add_argument("--log-level", default="info", help="treeverify.server log level")
    p.add_argument("--uvicorn-log-level", default="warning")
    return p


def run(args: argparse.Namespace) -> int:
    from treeverify import env

    try:
        env.configure_logging()
    except ValueError as exc:
        print(f"treeverify serve: {exc}", file=sys.stderr)
        return 2
    level = logging.getLevelName(str(args.log_level).upper())
    if not isinstance(level, int):
        print(f"--log-level: unknown level {args.log_level!r}", file=sys.stderr)
        return 64
    logging.getLogger("treeverify.server").setLevel(level)
    for name in (
        "context_length",
        "num_pages",
        "page_size",
        "max_running_requests",
        "max_num_batched_tokens",
        "chunked_prefill_size",
        "cuda_graph_max_bs",
        "port",
    ):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "port" else 1):
            print(f"--{name.replace('_', '-')}: must be >= 1, got {v}", file=sys.stderr)
            return 64
    if not 0.0 < args.mem_fraction_static < 1.0:
        print(f"--mem-fraction-static: must be in (0, 1), got {args.mem_fraction_static}",
              file=sys.stderr)  # fmt: skip
        return 64
    if args.speculative_adaptive and args.speculative_algorithm != "DDTREE":
        print("--speculative-adaptive: needs --speculative-algorithm DDTREE", file=sys.stderr)
        return 64
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"treeverify serve: needs fastapi and uvicorn ({exc})", file=sys.stderr)
        return 2
    from treeverify.server.main import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treeverify")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
