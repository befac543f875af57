"""What a round entered from plain decoding and left at once really costs (a probe, or a switch
undone): a helper of the adaptive controller (engine/budget_controller.py). Torch-free.

The cost table holds steady steps only (a round launched ahead and taken, a plain step launched
ahead), so a probe from plain decoding is priced there at a steady round's cost: ~3x a plain step
at b=8 on the H100. Its real price is larger: the plain step before it launches nothing, the
round is staged, launched and read with nothing overlapped (and projects the context rows pending
since the last round), and the plain step after it is read first: 1.3-2.9 ms for the round and
~0.6 ms for the step after, against ~0.26 ms a plain step (forty-first session,
`step_kinds --warm`, b=8), i.e. ~8-13 plain steps. `Excursions` watches every decode step's wall
time and, for each plain -> round -> plain pattern, keeps what the round's step and the plain
step after it cost beyond two plain steps, per batch size, for /server_info
(`adaptive.excursion_extra_seconds`): what the controller's probes from plain decoding cost.
The controller spaces its probes from plain decoding by this price from
`ControllerConfig.excursion_min_batch` requests up (2 by default; engine/budget_probes.py `due`):
everywhere, the replay lost predictable text at b=1 (0.93 -> 0.69 of the best fixed budget,
forty-first session); from 2 requests up every b=1 row is unchanged and the H100 ran b=8 prose
sampled at 0.866-0.871x -> 0.933-0.958x plain decoding (forty-second session; docs/ddtree.md).
"""

from __future__ import annotations

import statistics
from collections import deque


class Excursions:
    KEEP = 5  # the median of the last this many excursions per batch size

    def __init__(self) -> None:
        self._last_plain = False  # the previous decode step was plain
        self._round: tuple[int, float] | None = None  # a round entered from plain: (n, seconds)
        self._extra: dict[int, deque[float]] = {}  # batch size -> extra seconds, newest last
        self.count = 0

    def observe(self, n: int, budget: int | None, seconds: float,
                plain_cost: float | None) -> None:  # fmt: skip
        """One step: `n` decoding requests at `budget` (0: plain; None: not one budget for
        every decode, or prefill chunks beside them: the pattern starts over) for `seconds` of
        wall time; `plain_cost`: the table's plain step at n (None: unknown yet)."""
        if budget is None or n <= 0:
            self._last_plain, self._round = False, None
            return
        if budget == 0:
            if self._round is not None and plain_cost:
                rn, rsec = self._round
                if rn == n:  # the same requests' excursion (a batch change: not comparable)
                    self._extra.setdefault(n, deque(maxlen=self.KEEP)).append(
                        max(0.0, rsec + seconds - 2 * plain_cost)
                    )
                    self.count += 1
            self._round, self._last_plain = None, True
            return
        self._round = (n, seconds) if self._last_plain else None
        self._last_plain = False

    @property
    def pricing(self) -> bool:
        """A round entered from plain decoding was seen: the next plain step prices it (the
        only time `observe` reads plain's cost)."""
        return self._round is not None

    def extra(self, n: int) -> float | None:
        """The median extra seconds of the last excursions at batch size n or, none measured
        there, at the largest batch size below n that has some (a smaller batch's excursion
        costs no more: an underestimate, so probes are spaced no further than measured; a
        server's batch size moves with its traffic and seldom repeats an excursion at one
        size). None: none at n or below."""
        kept = self._extra.get(n)
        if not kept:
            below = [m for m, d in self._extra.items() if m < n and d]
            kept = self._extra[max(below)] if below else None
        return statistics.median(kept) if kept else None

    def info(self) -> dict[int, float]:
        """Batch size -> median extra seconds an excursion costs (/server_info)."""
        return {n: round(statistics.median(d), 6) for n, d in sorted(self._extra.items()) if d}
