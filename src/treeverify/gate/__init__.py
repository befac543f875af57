"""``treeverify gate``: decide whether a freshly (re)started inference service may take traffic.

Light on purpose: the standard library, httpx and numpy only (no torch, no engine/server
imports), so it runs on any box that can reach the service, against our server, SGLang or vLLM.
It uses only
``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (plain and streamed), plus our
``/server_info`` when the server has one.

Modules, one idea each:
  codes     exit codes and their precedence
  signatures  error signatures found in logs (Traceback, CUDA error, ...)
  targets   what is gated: a URL, a process it launches, a systemd unit
  client    HTTP: completions and chat (plain/streamed, timed) within the run's budget
  report    the live timeline, the verdict table, JSON and JUnit
  compare   the top-k tolerance at the first divergence
  evidence  a swap decided by the server's teacher-forced logprobs (near-tie or real, the gap)
  golden    the golden suite: prompts, recording, the file format
  probing   what probes share: context, failure classes, the agreement check
  probes    the named probes of the full gate (and their order)
  chat      the chat probe; sampled: seeded + frequency test; copying: long-context copy
  smoke     the seed's polling loop, reproduced faithfully
  runner    lifecycle -> readiness -> probes -> verdict
  cli       the command line
"""

from __future__ import annotations

from treeverify.gate.codes import ExitCode

__all__ = ["ExitCode"]
