"""The adaptive controller's recent decisions that moved it or measured something: probes,
switches and trials, each with the decision it came at and why. For whoever has to explain a
budget after the fact (/server_info's `adaptive.recent_decisions`, bench_pair's passes): the
counters say how many probes a pass made, this says when and from where (the thirty-ninth
session could only guess why every sampled group of 8 probed twice on the GPU). Torch-free.
"""

from __future__ import annotations

from collections import deque

# Events kept: a few groups' worth at the rate they come (a probe every 16-256 decisions, a
# switch per group), so one /server_info read covers the last minutes of a busy server.
KEPT_EVENTS = 128

# What an event is (its `kind`):
PROBE = "probe"  # one step at `to`, `current` stays at `from`
SWITCH = "switch"  # the rule moved on measured rates (margin, dwell, confirmation)
FIRST = "first"  # leaving the start (the top bucket), after the round that measured every budget
NEW_BATCH = "new_batch"  # a batch none of whose requests has rounds, moved on its class's prior
COST_TRIAL = "cost_trial"  # a dwell at a bucket whose cost is stale, to measure it
ACCEPT_TRIAL = "accept_trial"  # a dwell one bucket up, to measure its acceptance
TRIAL_BACK = "trial_back"  # an acceptance trial that did not pay, back where it came from
PLAIN_TRIAL = "plain_trial"  # a few plain steps to re-measure plain decoding's stale cost
# (they start at the next decision; `current` stays at `from`: a measurement, not a switch)
INTERVAL_RESTART = "interval_restart"  # the probes' interval back to its shortest (an arrival)


class DecisionEvents:
    """A bounded log of (decision index, kind, from, to, batch size, note)."""

    def __init__(self, kept: int = KEPT_EVENTS) -> None:
        self._log: deque[tuple[int, str, int, int, int, str]] = deque(maxlen=kept)
        self._dropped_through = -1  # the decision of the newest event no longer kept

    def add(self, step: int, kind: str, frm: int, to: int, n: int, note: str = "") -> None:
        if len(self._log) == self._log.maxlen:
            self._dropped_through = self._log[0][0]
        self._log.append((step, kind, frm, to, n, note))

    def complete_since(self, step: int) -> bool:
        """Whether every event after decision `step` is still kept."""
        return self._dropped_through <= step

    def since(self, step: int) -> list[dict]:
        """The events after decision `step` (those still kept), oldest first."""
        return [_as_dict(e) for e in self._log if e[0] > step]

    def recent(self, count: int = 32) -> list[dict]:
        """The last `count` events, oldest first."""
        return [_as_dict(e) for e in list(self._log)[-count:]]


def _as_dict(event: tuple[int, str, int, int, int, str]) -> dict:
    step, kind, frm, to, n, note = event
    return {"step": step, "kind": kind, "from": frm, "to": to, "n": n} | (
        {"note": note} if note else {}
    )
