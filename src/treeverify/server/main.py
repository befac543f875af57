"""``serve(args)``: load the engine, start the engine loop, run uvicorn, shut down cleanly.

Startup phases are logged with durations (model load; KV pool sized from --mem-fraction-static
and allocated; warmup forward; CUDA-graph capture per bucket on a GPU; ready). A capture failure
is a startup error naming the bucket (exit 1), never a silent fallback to eager. With systemd
``Type=notify`` the server sends ``READY=1`` on ``$NOTIFY_SOCKET`` once it accepts connections and
``STOPPING=1`` when shutdown begins. SIGTERM (or SIGINT): drain with the socket still open
(/health and new requests answer 503 "shutting down", so load balancers see a clear answer, not a
refused connection), let in-flight requests finish for ``--shutdown-grace`` seconds, cancel the
rest (finish_reason "abort"), then close and exit 0. A second signal skips the wait.

Environment (read through treeverify.env): ``NOTIFY_SOCKET`` (systemd), ``TREEVERIFY_TEST_HOOKS=1``
(TEST ONLY: adds the /_test/stall and /_test/resume endpoints that freeze the engine loop).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from treeverify import env

log = logging.getLogger("treeverify.server")


def notify(state: str) -> bool:
    """Send ``state`` (e.g. "READY=1") to systemd's $NOTIFY_SOCKET; False when there is none."""
    addr = env.notify_socket()
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify %r to %r failed: %s", state, addr, exc)
        return False
    return True


def _planted_capture_faults() -> None:
    """TEST ONLY (TREEVERIFY_FAULT, engine/faults.py): fail or hang the capture phase."""
    from treeverify.engine import faults

    if faults.active("capture_crash") is not None:
        log.error("startup: CUDA graph capture failed (planted fault capture_crash)")
        raise SystemExit(1)
    if faults.active("capture_hang") is not None:
        log.error("startup: graph capture hanging (planted fault capture_hang)")
        while True:
            time.sleep(3600)


def _phase(name: str, t0: float, detail: str = "") -> None:
    log.info(
        "startup: %s done in %.2f s%s",
        name,
        time.monotonic() - t0,
        f" ({detail})" if detail else "",
    )


def build_engine(args: argparse.Namespace) -> tuple[Any, int]:
    """The LLM and the context length it serves (the model's, capped by flags and KV capacity)."""
    import torch

    from treeverify.engine.cuda_graphs import GraphCaptureError
    from treeverify.engine.llm import LLM
    from treeverify.models.gguf_loader import MissingPackageError

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model = getattr(args, "model_path", None) or args.model  # resolved by cli.run
    t0 = time.monotonic()
    log.info(
        "startup: engine init (load %s on %s; KV %s; graphs %s) ...",
        args.model,
        device,
        f"{args.num_pages} pages" if args.num_pages else "from --mem-fraction-static",
        "off" if args.disable_cuda_graph or device == "cpu" else "on",
    )
    try:
        llm = LLM(
            model,
            dtype=dtype,
            num_pages=args.num_pages,
            page_size=args.page_size,
            max_num_seqs=args.max_running_requests,
            max_num_batched_tokens=args.max_num_batched_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            attention_backend=args.attention_backend,
            device=device,
            speculative_algorithm=args.speculative_algorithm,
            speculative_ddtree_budget=args.speculative_ddtree_budget,
            speculative_num_draft_tokens=args.speculative_num_draft_tokens,
            speculative_draft_model_path=args.speculative_draft_model_path,
            speculative_adaptive=args.speculative_adaptive,
            speculative_controller=tuple(getattr(args, "speculative_controller", ()) or ()),
            mem_fraction_static=args.mem_fraction_static,
            cuda_graph_max_bs=args.cuda_graph_max_bs,
            disable_cuda_graph=args.disable_cuda_graph,
            disable_round_graphs=args.disable_round_graphs,
            round_lookahead=False if args.disable_round_lookahead else None,
            decode_lookahead={"auto": None, "on": True, "off": False}[args.decode_lookahead],
            disable_prefill_graphs=args.disable_prefill_graphs,
        )
    except GraphCaptureError as exc:
        log.error("startup: %s", exc)
        raise SystemExit(1) from exc
    except MissingPackageError as exc:  # an optional model's package: one line, no traceback
        print(f"treeverify serve: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except (FileNotFoundError, ValueError) as exc:  # a broken model directory, a bad flag value
        log.error("startup: cannot start (--model %s): %s", args.model, exc)
        raise SystemExit(2) from None
    template = getattr(args, "chat_template_text", None)
    if template is not None:
        llm.tokenizer.chat_template = template
        log.info("startup: chat template from %s", args.chat_template)
    st = llm.startup
    log.info("startup: model load done in %s s", st.get("load_seconds"))
    log.info("startup: %s (allocated in %s s)", st["kv"], st.get("kv_alloc_seconds"))
    log.info("startup: warmup forward done in %s s", st.get("warmup_seconds"))
    if "graphs" in st:
        log.info(
            "startup: graph capture done in %s s (%d buckets)",
            st.get("capture_seconds"),
            len(st["graphs"]),
        )
    else:
        log.info("startup: graph capture skipped (%s)", llm.cuda_graph_info.get("reason"))
    _phase("engine init", t0)
    capacity = llm.capacity_tokens
    model_ctx = int(getattr(llm.model_config, "max_position_embeddings", capacity))
    ctx = min(args.context_length or model_ctx, model_ctx, capacity)
    if args.context_length and args.context_length > ctx:
        log.warning(
            "--context-length %d capped to %d (model %d, KV capacity %d)",
            args.context_length,
            ctx,
            model_ctx,
            capacity,
        )
    _planted_capture_faults()
    return llm, ctx


def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; 0 on a clean shutdown."""
    import uvicorn

    from treeverify import __version__
    from treeverify.server.app import create_app
    from treeverify.server.engine_loop import EngineLoop

    t_start = time.monotonic()
    llm, ctx = build_engine(args)
    # What startup made (the model, graphs, tables: ~310k tracked objects on tiny-code) lives
    # as long as the process: out of the cyclic collector's reach, where a full collection
    # over it took 125-141 ms on a CPU (scripts/gc_pause.py), a pause in some later step (one
    # engine per process here, so nothing frozen becomes garbage; the library's LLM leaves GC
    # alone).
    gc.collect()
    gc.freeze()
    log.info("startup: %d objects frozen out of the garbage collector", gc.get_freeze_count())
    engine = EngineLoop(llm)
    engine.start()
    name = args.served_model_name or args.model
    flags = {k: v for k, v in vars(args).items() if k not in ("run", "func", "chat_template_text")}
    if flags.get("api_key"):
        flags["api_key"] = "<redacted>"  # never shown, never logged
    info = {
        "server_args": flags,
        "attention_backend": llm.attention_backend,
        "startup": {k: v for k, v in llm.startup.items() if k != "graphs"}
        | {"gc_frozen_objects": gc.get_freeze_count()},
    }
    app = create_app(
        engine,
        name,
        ctx,
        info=info,
        heartbeat_timeout_s=args.health_heartbeat_timeout,
        health_generate_timeout_s=args.health_generate_timeout,
        default_max_tokens=args.default_max_tokens,
        enable_test_hooks=env.test_hooks_enabled(),
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=int(args.shutdown_grace) + 5,
        access_log=False,
    )

    def ready() -> None:
        log.info(
            "startup: ready: serving %r on http://%s:%d (context %d; %s) after %.2f s; "
            "treeverify %s",
            name,
            args.host,
            args.port,
            ctx,
            "bearer key required" if args.api_key else "no API key: open to anyone who connects",
            time.monotonic() - t_start,
            __version__,
        )
        notify(f"READY=1\nSTATUS=serving {name}\nMAINPID={os.getpid()}")

    def stopping() -> None:
        log.info(
            "shutdown: draining (grace %.1f s): new requests and health get 503, in-flight "
            "ones finish",
            args.shutdown_grace,
        )
        notify("STOPPING=1")
        engine.drain(args.shutdown_grace)

    def drained() -> bool:
        return engine.in_flight() == 0

    server = _Server(config, ready, stopping, drained, args.shutdown_grace + 2.0)
    # uvicorn restores the previous SIGTERM/SIGINT handlers after its graceful shutdown and
    # re-raises the signal: make those no-ops so a requested shutdown exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        engine.stop()
    log.info("shutdown: done")
    return 0 if server.started else 1


class _Server:
    """uvicorn.Server with readiness and drain callbacks (built lazily: uvicorn is optional).

    The first SIGTERM/SIGINT starts the drain but keeps the socket open, so clients get 503s
    (not refused connections) until the in-flight requests are done or ``max_drain_s`` has
    passed; only then does uvicorn's own shutdown begin. A second signal skips the wait.
    """

    def __new__(cls, config, on_ready, on_exit, drained, max_drain_s: float):
        import uvicorn

        class Server(uvicorn.Server):
            draining = False

            async def startup(self, sockets=None) -> None:
                await super().startup(sockets)
                if self.started:
                    on_ready()

            def handle_exit(self, sig, frame) -> None:
                if self.draining or self.should_exit:
                    super().handle_exit(sig, frame)
                    return
                self.draining = True
                on_exit()
                threading.Thread(target=self._exit_when_drained, daemon=True).start()

            def _exit_when_drained(self) -> None:
                deadline = time.monotonic() + max_drain_s
                while not drained() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.2)  # let the last responses leave before the listener closes
                self.should_exit = True

        return Server(config)
