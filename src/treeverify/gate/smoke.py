"""``--probes smoke``: the seed's polling loop, reproduced faithfully so people can compare.

The seed, as a loop: up to 28 times, sleep 30 s; if ``systemctl is-active UNIT`` says ``failed``,
stop (FAILED); else POST "The capital of France is" (temperature 0, max_tokens 8) with a 12 s
timeout and accept as soon as the JSON has ``choices``; print elapsed time and state each step and
the text at the end. Nothing else is checked: not the text, not long context, not batching. For a
launched process, "failed" is the process having exited (systemd's failed for ``Restart=no``).
"""

from __future__ import annotations

import time

import httpx

from treeverify.gate.codes import ExitCode
from treeverify.gate.report import ProbeResult, Report

PROMPT = "The capital of France is"
INTERVAL = 30.0
TRIES = 28
REQUEST_TIMEOUT = 12.0
MAX_TOKENS = 8


def run(
    target,
    url: str,
    report: Report,
    model: str | None = None,
    interval: float = INTERVAL,
    tries: int = TRIES,
    request_timeout: float = REQUEST_TIMEOUT,
    api_key: str | None = None,
) -> ProbeResult:
    t0 = time.monotonic()
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=request_timeout, headers=headers) as http:
        for i in range(1, tries + 1):
            time.sleep(interval)
            if target.smoke_failed():
                down = target.check()
                detail = down.detail if down else "unit is-active: failed"
                report.event("smoke", "FAILED", f"try {i}: {detail}")
                return ProbeResult(
                    "smoke", "fail", detail, ExitCode.UNIT_FAILED, time.monotonic() - t0
                )
            try:
                if model is None:  # OpenAI servers want a model name; the seed hard-coded it
                    model = http.get(url + "/v1/models").json()["data"][0]["id"]
                r = http.post(url + "/v1/completions", json={"model": model, **body}).json()
                if isinstance(r, dict) and "choices" in r:
                    text = (r["choices"] or [{}])[0].get("text", "")
                    report.event("smoke", "READY", f"try {i}: {text!r}")
                    return ProbeResult(
                        "smoke",
                        "pass",
                        f"READY after {i} tries: {text!r}",
                        seconds=time.monotonic() - t0,
                        data={"text": text, "tries": i},
                    )
            except Exception:  # the seed's curl 2>/dev/null: any failure means "not yet"
                pass
            report.event("smoke", "waiting", f"try {i}: {target.state()}")
    return ProbeResult(
        "smoke",
        "fail",
        f"not ready after {tries} tries x {interval:g} s",
        ExitCode.HUNG,
        time.monotonic() - t0,
    )
