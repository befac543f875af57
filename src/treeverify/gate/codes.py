"""Exit codes of ``treeverify gate`` and which one wins when several probes fail."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    PASS = 0
    PERF_REGRESSION = 1
    CORRECTNESS = 2
    INFRA = 3
    UNIT_FAILED = 4  # unit failed / crash-looping, or the launched process died
    HUNG = 5  # never ready within the budget, or a request stalled past its deadline
    USAGE = 64


# Most severe first: a dead process explains any failed request, a hang explains timeouts, a
# wrong answer is a definite finding, an infrastructure error is an inconclusive one, a slow
# answer is the least severe.
PRECEDENCE = (
    ExitCode.UNIT_FAILED,
    ExitCode.HUNG,
    ExitCode.CORRECTNESS,
    ExitCode.INFRA,
    ExitCode.PERF_REGRESSION,
)


def worst(codes) -> ExitCode:
    """The exit code for a run whose failures had these codes (PASS when none)."""
    codes = {ExitCode(c) for c in codes}
    for c in PRECEDENCE:
        if c in codes:
            return c
    return ExitCode.PASS
