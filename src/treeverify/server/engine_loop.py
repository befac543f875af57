"""The bridge between asyncio request handlers and the (not thread-safe) engine.

One background thread owns the ``LLM``: it drains a thread-safe command queue (add, abort), runs
one ``llm.step()`` when there is work, and hands each request's new tokens to the asyncio loop of
its handler with ``call_soon_threadsafe``. Each loop iteration stamps a heartbeat that /health
reads: a loop stuck in a step (or deadlocked) shows as a stale heartbeat.

Events put on a job's queue: ``Event(index, token_ids, logprobs, finish_reason, text, error)``;
the last event of a choice has ``finish_reason`` set (or ``error`` when the engine refused or
failed the request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from treeverify.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from treeverify.engine.llm import LLM

log = logging.getLogger("treeverify.server")

IDLE_SLEEP_S = 0.002
# The speculation counters' snapshot (~25 us of Python: the adaptive controller's info) is
# rebuilt at most this often while requests run, and right after the last one finishes: a
# 0.2 ms launched-ahead step on a small model is host-bound, so every step paid it before.
SPEC_STATS_EVERY_S = 0.1


@dataclass
class Event:
    index: int  # choice index within the job
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)  # TokenLogprobs | None per token
    finish_reason: str | None = None
    text: str | None = None  # final text (stop strings cut), on the finishing event
    error: str | None = None
    error_status: int = 400  # 400: the engine refused the request; 500: a step failed
    prompt_logprobs: list[Any] | None = None  # on a choice's first event, when asked for


@dataclass
class Job:
    """One HTTP request's engine requests (one per choice) and the queue their events go to."""

    request_ids: list[str]
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    created: float = field(default_factory=time.monotonic)


@dataclass
class _Active:
    seq: Any
    job: Job
    index: int
    sent: int = 0


@dataclass
class Stats:
    """A snapshot written by the engine thread, read by /server_info and /metrics."""

    running: int = 0
    waiting: int = 0
    used_pages: int = 0
    num_pages: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    steps: int = 0
    step_errors: int = 0
    moe_imbalance: float | None = None
    spec: dict | None = None  # the engine's speculation counters (None: speculation off)


class EngineLoop:
    """Owns ``llm`` on a daemon thread; other threads use ``submit`` and ``abort`` only."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, _Active] = {}
        self._thread = threading.Thread(target=self._run, name="treeverify-engine", daemon=True)
        self._stop = threading.Event()
        self._stalled = threading.Event()
        self._draining = False
        self._abort_all_at: float | None = None
        self.heartbeat = time.monotonic()
        self.stats = Stats(num_pages=llm.config.num_pages)
        self._last_moe = 0.0
        self._last_spec = 0.0
        self._spec_stale = True  # steps ran since the speculation snapshot was taken

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._stalled.clear()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def drain(self, grace_s: float) -> None:
        """Stop taking new requests; abort whatever is still running after ``grace_s`` seconds."""
        self._draining = True
        self._commands.put(("drain", time.monotonic() + max(0.0, grace_s)))

    @property
    def accepting(self) -> bool:
        return not self._draining and self._thread.is_alive()

    def in_flight(self) -> int:
        """Requests added and not yet finished; +1 while commands still wait in the queue."""
        return len(self._active) + (0 if self._commands.empty() else 1)

    def heartbeat_age(self) -> float:
        return time.monotonic() - self.heartbeat

    # ---- test-only hook ------------------------------------------------------------------------
    def stall(self) -> None:
        """TEST ONLY: freeze the loop (no steps, no heartbeat) to simulate a stuck engine."""
        self._stalled.set()

    def resume(self) -> None:
        """TEST ONLY: undo ``stall``."""
        self._stalled.clear()

    # ---- requests (any thread) -----------------------------------------------------------------
    def submit(self, prompts: list[tuple[list[int], SamplingParams]], prefix: str = "") -> Job:
        """Queue one engine request per (prompt ids, params); call from the handler's loop."""
        _planted_first_request_crash()  # TEST ONLY: a no-op unless that fault is planted
        loop = asyncio.get_running_loop()
        base = f"{prefix or 'req'}-{uuid.uuid4().hex[:16]}"
        job = Job([f"{base}-{i}" for i in range(len(prompts))], asyncio.Queue(), loop)
        if not self.accepting:
            raise RuntimeError(
                "the server is shutting down (draining after SIGTERM); retry on another replica"
            )
        self._commands.put(("add", job, prompts))
        return job

    def abort(self, job: Job) -> None:
        """Abort every unfinished request of ``job`` (finish_reason 'abort')."""
        self._commands.put(("abort", job))

    # ---- the engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if self._stalled.is_set():  # test hook: spin without a heartbeat
                time.sleep(0.01)
                continue
            self.heartbeat = time.monotonic()
            try:
                self._iterate()
            except Exception as exc:  # never let the engine thread die: fail what is in flight
                log.exception("engine loop iteration failed")
                self.stats.step_errors += 1
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
        for rid in list(self._active):  # shutting down: nobody is left waiting forever
            self._abort_one(rid)

    def _iterate(self) -> None:
        """One loop iteration: commands, the drain deadline, one engine step (or a short nap)."""
        self._handle_commands()
        if self._abort_all_at is not None and time.monotonic() >= self._abort_all_at:
            for rid in list(self._active):
                self._abort_one(rid)
        if self._active and self.llm.has_unfinished():
            self._step()
        else:
            time.sleep(IDLE_SLEEP_S)
        self._update_stats()

    def _handle_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._add(cmd[1], cmd[2])
            elif cmd[0] == "abort":
                for rid in cmd[1].request_ids:
                    self._abort_one(rid)
            elif cmd[0] == "drain":
                self._abort_all_at = cmd[1]

    def _add(self, job: Job, prompts: list[tuple[list[int], SamplingParams]]) -> None:
        for i, (rid, (ids, params)) in enumerate(zip(job.request_ids, prompts, strict=True)):
            try:
                seq = self.llm.add_request(ids, params, rid)
            except (ValueError, RuntimeError) as exc:  # refused (e.g. over the KV pool)
                self._emit(job, Event(i, error=str(exc)))
                continue
            except Exception as exc:
                log.exception("add_request failed for %s", rid)
                self._emit(job, Event(i, error=f"{type(exc).__name__}: {exc}", error_status=500))
                continue
            self._active[rid] = _Active(seq, job, i)
            self.stats.prompt_tokens += len(ids)

    def _abort_one(self, rid: str) -> None:
        act = self._active.pop(rid, None)
        if act is None:
            return
        self.llm.abort(rid)
        out = self.llm.output(act.seq)
        self.stats.aborted_requests += 1
        self._flush(act, out.logprobs, finish_reason="abort", text=out.text,
                    prompt_logprobs=out.prompt_logprobs)  # fmt: skip

    def _step(self) -> None:
        self._spec_stale = True  # (a failed step may have moved the counters too)
        try:
            finished = self.llm.step()
        except Exception as exc:  # one bad step must not kill the service: fail its requests
            log.exception("engine step failed; failing the in-flight requests")
            self.stats.step_errors += 1
            self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
            return
        self.stats.steps += 1
        done = {s.request_id for s in finished}
        for rid, act in list(self._active.items()):
            if rid in done:
                continue
            if len(act.seq.output_token_ids) > act.sent:
                self._flush(act, self.llm.logprobs_so_far(rid),
                            prompt_logprobs=self.llm.prompt_logprobs(rid))  # fmt: skip
        for seq in finished:
            act = self._active.pop(seq.request_id, None)
            if act is None:
                continue
            out = self.llm.output(seq)
            self.stats.finished_requests += 1
            self._flush(act, out.logprobs, finish_reason=out.finish_reason, text=out.text,
                        prompt_logprobs=out.prompt_logprobs)  # fmt: skip

    def _flush(
        self,
        act: _Active,
        logprobs: list[Any],
        finish_reason: str | None = None,
        text: str | None = None,
        prompt_logprobs: list[Any] | None = None,
    ) -> None:
        """Send the tokens of ``act`` not yet sent, with the finish (one event: the final text
        must arrive with the token that ended the request, so stop strings are never streamed)."""
        toks = list(act.seq.output_token_ids[act.sent :])
        if not toks and finish_reason is None:
            return
        lps = list(logprobs[act.sent : act.sent + len(toks)])
        lps += [None] * (len(toks) - len(lps))
        first = act.sent == 0  # the prompt's logprobs (complete by now) go with the first event
        act.sent += len(toks)
        self.stats.generated_tokens += len(toks)
        self._emit(act.job, Event(act.index, toks, lps, finish_reason, text,
                                  prompt_logprobs=prompt_logprobs if first else None))  # fmt: skip

    def _fail_all(self, message: str) -> None:
        for rid, act in list(self._active.items()):
            self._active.pop(rid)
            try:
                self.llm.abort(rid)
                self.llm.output(act.seq)
            except Exception:  # the scheduler may be mid-batch after a failed step
                log.exception("could not abort %s", rid)
            self._emit(act.job, Event(act.index, error=message, error_status=500))
        self._reset_scheduler_batch()

    def _reset_scheduler_batch(self) -> None:
        self.llm.recover_after_failed_step()  # the failed batch never reaches postprocess

    @staticmethod
    def _emit(job: Job, event: Event) -> None:
        with contextlib.suppress(RuntimeError):  # a closed handler loop: nobody listens
            job.loop.call_soon_threadsafe(job.queue.put_nowait, event)

    def _update_stats(self) -> None:
        s = self.stats
        use = self.llm.usage()
        s.running, s.waiting, s.used_pages = use.running, use.waiting, use.used_pages
        now = time.monotonic()
        if self._spec_stale and (not self._active or now - self._last_spec >= SPEC_STATS_EVERY_S):
            self._spec_stale, self._last_spec = False, now
            s.spec = self.llm.spec_stats
        if now - self._last_moe >= 1.0:  # reading the device counters syncs: once a second
            self._last_moe = now
            s.moe_imbalance = self.llm.moe_imbalance()


def _planted_first_request_crash() -> None:
    """TEST ONLY (TREEVERIFY_FAULT=first_request_crash, engine/faults.py): die like a kernel
    fault on the first request served over HTTP."""
    from treeverify.engine import faults

    if faults.active("first_request_crash") is not None:
        print(
            "RuntimeError: CUDA error: an illegal memory access was encountered "
            "(planted fault first_request_crash)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
