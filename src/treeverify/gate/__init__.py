"""``treeverify gate``: decide whether a freshly (re)started inference service may take traffic.

Light on purpose: the standard library and httpx only (no torch, no engine/server imports), so it
runs on any box that can reach the service, against our server, SGLang or vLLM. It uses only
``/v1/models``, ``/v1/completions`` (plain and streamed) and ``/health``, plus our
``/server_info`` when the server has one.

Modules, one idea each:
  codes     exit codes and their precedence
  signatures  error signatures found in logs (Traceback, CUDA error, ...)
  targets   what is gated: a URL, a process it launches, a systemd unit
  client    HTTP: completions (plain/streamed, timed), models, server info
  report    the live timeline, the verdict table, JSON and JUnit
  compare   the top-k tolerance at the first divergence
  golden    the golden suite: prompts, recording, the file format
  probes    the named probes of the full gate
  smoke     the seed's polling loop, reproduced faithfully
  runner    lifecycle -> readiness -> probes -> verdict
  cli       the command line
"""

from __future__ import annotations

from treeverify.gate.codes import ExitCode

__all__ = ["ExitCode"]
