"""``treeverify serve``: flags in SGLang's spelling (``--mem-fraction-static``, ``--tp-size``, ...).

GPU-only flags (--mem-fraction-static, --cuda-graph-max-bs, --disable-cuda-graph) are accepted on
the CPU too and have no effect there (the CPU engine is eager, with --num-pages pages); every flag
is recorded in /server_info (the API key redacted) so a deployment can pass SGLang-style arguments
unchanged. Bad values are usage errors: serve's usage and exit 2, from argparse itself.
Also runnable alone: ``python -m treeverify.server.cli serve --model tiny-code --port 30000``.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

from treeverify.server.guards import DEFAULT_MAX_REQUEST_BYTES
from treeverify.strict_args import int_at_least, own_unknown_flags

DTYPES = ("auto", "bfloat16", "float16", "float32")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's names


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' where a flag has a default its help does not already state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def _fraction(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not 0.0 < x < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {x}")
    return x


def _seconds(low: float, inclusive: bool):
    """Finite seconds >= low (> low unless inclusive): nan or inf would never time out."""

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
        if not math.isfinite(x) or x < low or (x == low and not inclusive):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>=' if inclusive else '>'} {low:g}, got {value}"
            )
        return x

    parse.__name__ = "float"
    return parse


def _tp_size(value: str) -> int:
    n = int_at_least(1)(value)
    if n > 1:
        raise argparse.ArgumentTypeError(
            f"{n}: treeverify serve runs one GPU (tensor parallelism is not built in); to serve "
            "over several GPUs run SGLang (--tp-size N) with treeverify's verify kernel: "
            "treeverify.kernels.sglang is a drop-in for its target-verify attention"
        )
    return n


def _log_level(value: str) -> str:
    if not isinstance(logging.getLevelName(value.upper()), int):
        raise argparse.ArgumentTypeError(
            f"unknown level {value!r} (debug, info, warning, error, critical)"
        )
    return value


def _uvicorn_log_level(value: str) -> str:
    if value.lower() not in UVICORN_LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"unknown level {value!r} ({', '.join(UVICORN_LOG_LEVELS)})"
        )
    return value.lower()  # uvicorn looks its levels up in lower case


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (FastAPI + uvicorn)",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions).",
        formatter_class=_HelpFormatter,
    )
    own_unknown_flags(p)  # serve's usage, exit 2
    pos = int_at_least(1)
    positive_s, at_least_0_s = _seconds(0.0, inclusive=False), _seconds(0.0, inclusive=True)
    p.add_argument(
        "--model",
        "--model-path",
        dest="model",
        default="tiny-code",
        help="a built-in model (tiny-code: trained on Python, shipped; tiny-llama, tiny-kimi: "
        "seeded, for tests; smollm2-135m with the smollm2 extra), a local Hugging Face "
        "directory, or a hub id (org/name) already in the local Hugging Face cache (never "
        "downloaded)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int_at_least(0, 65535), default=30000, help="TCP port")
    p.add_argument("--served-model-name", help="model id clients use (default: --model)")
    p.add_argument("--context-length", type=pos, help="max prompt + output tokens per request")
    p.add_argument(
        "--attention-backend",
        choices=("auto", "torch", "triton", "cuda"),
        default="auto",
        help="auto: cuda on a GPU, torch on the CPU",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when available")
    p.add_argument(
        "--num-pages",
        type=pos,
        help="KV pages in the pool (default: from --mem-fraction-static on a GPU, 512 on CPU)",
    )
    p.add_argument("--page-size", type=pos, default=16, help="tokens per KV page")
    p.add_argument("--max-running-requests", type=pos, default=64, help="requests decoding at once")
    p.add_argument(
        "--max-num-batched-tokens", type=pos, default=2048, help="tokens per engine step"
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=pos,
        help="largest prefill chunk (default: --max-num-batched-tokens)",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=_fraction,
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
        "--disable-round-graphs",
        action="store_true",
        help="run every speculative round piece by piece (draft, build, verify, accept) instead "
        "of greedy rounds as one replay each (DFlash and n-gram drafts) (a debugging switch, "
        "and the escape hatch should whole rounds misbehave)",
    )
    p.add_argument(
        "--disable-round-lookahead",
        action="store_true",
        help="read each whole round's result before launching the next (by default on a GPU the "
        "next round is launched first, so the host's bookkeeping overlaps the GPU)",
    )
    p.add_argument(
        "--decode-lookahead",
        choices=("auto", "on", "off"),
        default="auto",
        help="launch each plain greedy decode step before reading the previous one's tokens, so "
        "the host's part overlaps the GPU (auto: on where CUDA graphs are captured, unless "
        "TREEVERIFY_DECODE_LOOKAHEAD=0; off on the CPU)",
    )
    p.add_argument(
        "--disable-prefill-graphs",
        action="store_true",
        help="run every prefill eagerly (by default on a GPU one request's prefill chunk of up "
        "to 512 tokens replays a captured graph, padded to 32/64/.../512 tokens)",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=pos,
        help="GPU: largest decode batch captured (default min(--max-running-requests, 32))",
    )
    p.add_argument(
        "--speculative-algorithm",
        choices=("DDTREE", "CHAIN"),
        help='speculative decoding (per-request opt-out: "speculative": false)',
    )
    p.add_argument(
        "--speculative-ddtree-budget",
        type=int_at_least(1, 1024),  # engine.config.MAX_TREE_BUDGET: refused before the load
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
        "--speculative-controller",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="an adaptive budget controller knob (repeatable), e.g. plain_margin=0.05; the knobs "
        "and defaults: engine/budget_config.py, docs/ddtree.md; /server_info shows those in force",
    )
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=pos,
        help="draft depth L (positions proposed per round; default: a DFlash drafter's block "
        "size - 1, the n-gram drafter's 4)",
    )
    p.add_argument(
        "--speculative-draft-model-path",
        help="the drafter: 'ngram' (weight-free), a DFlash drafter directory (published "
        "format), 'tiny-code-dflash' (shipped), or 'tiny-dflash' (seeded, for tiny-llama tests); "
        "default: the model's own shipped drafter (tiny-code -> tiny-code-dflash), else ngram",
    )
    p.add_argument(
        "--default-max-tokens",
        type=pos,
        help="cap on max_tokens for a request that leaves it out (default: none, such a request "
        "may fill the rest of the context, as with OpenAI)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file (default: the model's chat_template.jinja, else "
        "tokenizer_config.json's chat_template)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights and KV dtype (auto: bfloat16 on a GPU, float32 on the CPU)",
    )
    p.add_argument(
        "--tp-size",
        "--tp",
        dest="tp_size",
        type=_tp_size,
        default=1,
        help="tensor parallel size; only 1 (use SGLang with treeverify's kernels for more)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for SGLang compatibility; no effect (no model code is ever downloaded)",
    )
    auth = p.add_argument_group("security and limits")
    auth.add_argument(
        "--api-key",
        help="bearer key every route but /health and /health_generate requires (default: "
        "$TREEVERIFY_API_KEY; neither set: no authentication)",
    )
    auth.add_argument(
        "--max-request-bytes",
        type=pos,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies are refused with 413 before they are read (bytes)",
    )
    p.add_argument(
        "--health-heartbeat-timeout",
        type=positive_s,
        default=10.0,
        help="/health is 503 once the engine loop is silent this long (s)",
    )
    p.add_argument(
        "--health-generate-timeout",
        type=positive_s,
        default=10.0,
        help="/health_generate is 503 if its 1-token request takes longer (s)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=at_least_0_s,
        default=10.0,
        help="on SIGTERM, seconds in-flight requests may finish before 'abort'",
    )
    p.add_argument(
        "--log-level", type=_log_level, default="info", help="treeverify.server log level"
    )
    p.add_argument(
        "--uvicorn-log-level",
        type=_uvicorn_log_level,
        default="warning",
        help=f"uvicorn's own log level ({', '.join(UVICORN_LOG_LEVELS)})",
    )
    return p


def run(args: argparse.Namespace) -> int:
    from treeverify import env

    try:
        env.configure_logging()
    except ValueError as exc:
        print(f"treeverify serve: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("treeverify.server").setLevel(args.log_level.upper())
    if args.api_key is not None and not args.api_key.strip():  # auth off by an empty value
        print("treeverify serve: --api-key: empty; omit it to serve without a key",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.api_key is None:
        try:
            args.api_key = env.api_key()
        except ValueError as exc:
            print(f"treeverify serve: {exc}", file=sys.stderr)
            return 2
    if args.speculative_adaptive and args.speculative_algorithm != "DDTREE":
        print("treeverify serve: --speculative-adaptive: needs --speculative-algorithm DDTREE",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.speculative_controller:  # EngineConfig's check, before the model loads: exit 2
        from treeverify.engine.config import EngineConfig

        try:
            EngineConfig(model=args.model, speculative_algorithm=args.speculative_algorithm,
                         speculative_adaptive=args.speculative_adaptive,
                         speculative_controller=tuple(args.speculative_controller))  # fmt: skip
        except ValueError as exc:
            name, _, problem = str(exc).partition(": ")
            if name == "speculative_controller":  # (any other argument: reported at startup)
                print(f"treeverify serve: --speculative-controller: {problem}", file=sys.stderr)
                return 2
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        print(f"treeverify serve: needs fastapi and uvicorn ({exc})", file=sys.stderr)
        return 2
    from treeverify.models.resolve import ModelNotFound, resolve_model

    try:
        args.model_path = resolve_model(args.model)
        if args.chat_template is not None:
            args.chat_template_text = _read_template(args.chat_template)
    except (ModelNotFound, OSError) as exc:
        print(f"treeverify serve: {exc}", file=sys.stderr)
        return 2
    if args.trust_remote_code:
        logging.getLogger("treeverify.server").info(
            "--trust-remote-code: accepted for SGLang compatibility; it has no effect here "
            "(treeverify runs its own model code, never a checkpoint's)"
        )
    from treeverify.server.main import serve

    return serve(args)


def _read_template(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise OSError(f"--chat-template: cannot read {path}: {exc.strerror or exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="treeverify", formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
