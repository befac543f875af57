"""Step cost by (batch size, budget) for the adaptive budget (engine/budget_controller.py):
measured medians, interpolation and borrowing for batch sizes not measured, and which entries
were measured recently while serving ("fresh") as opposed to carried over from calibration or
from long ago. Torch-free."""

from __future__ import annotations

import statistics
from collections import deque

# A cost at least this many times the lowest median its entry held was overstated by a burst of
# slow host steps (engine/cost_bursts.py), fresh or not: a trial re-measures it, weighed at that
# lowest median.
BURST_FACTOR = 2.0


class CostModel:
    """Seconds per step by (batch size, budget): the median of the last `window` measured steps
    (a context switch or a stall moves a median little). A batch size not measured yet is
    interpolated linearly between the measured sizes around it at that budget, else borrows the
    nearest measured one's value, scaled by the plain-step ratio when both have one (so only the
    budgets' relative cost is borrowed). `frozen`: a given curve, never updated.

    Freshness: `observe(..., at=step)` records the controller's step index of the measurement;
    `lower_bound` gives, from the fresh entries only, the least a budget can cost (a larger tree
    is never cheaper than a smaller one). The controller tries a budget whose stale cost hides
    a better rate (docs/ddtree.md, "Stale costs").

    Bursts: `best` keeps each entry's lowest median so far. A burst of slow host steps (ten to
    thirty steps at 1-2.5 ms where a plain step takes 0.18, seen on a shared H100 host in the
    plain engine too) fills a window of 9 and leaves a median 10x too high that nothing at
    that budget re-measures while the controller avoids it; the lowest median says what the
    entry has cost, so a trial can be weighed against it, and `restart` lets a trial's few
    steps outvote the burst's window."""

    def __init__(self, window: int = 9, frozen: bool = False):
        self.window, self.frozen = window, frozen
        self.table: dict[tuple[int, int], deque[float]] = {}
        self._median: dict[tuple[int, int], float] = {}  # kept current: read every step
        self._nearest: dict[tuple[int, int], int | None] = {}  # (n, budget) -> measured size
        self._brackets: dict[tuple[int, int], tuple[int, int] | None] = {}  # measured around n
        self.seen_at: dict[tuple[int, int], int] = {}  # step index of the last serving sample
        self.best: dict[tuple[int, int], float] = {}  # the lowest median each entry has held

    @classmethod
    def given(cls, seconds_by_budget: dict[int, float]) -> CostModel:
        """A fixed curve at batch size 1 (a cost file, or a test's synthetic curve)."""
        m = cls(window=1)
        for b, sec in seconds_by_budget.items():
            if not sec > 0:
                raise ValueError(f"cost of budget {b}: expected seconds > 0, got {sec}")
            m.table[(1, int(b))] = deque([float(sec)], maxlen=1)
            m._median[(1, int(b))] = m.best[(1, int(b))] = float(sec)
        m.frozen = True
        return m

    def stale_copy(self) -> CostModel:
        """The same medians, every entry stale and one sample deep (a frozen model: itself):
        what a step path not measured yet starts from (engine/budget_controller.py, "Step
        paths"). One sample, so that the path's own steps outvote it from their second on (a
        copy of a full window would take five to move the median)."""
        if self.frozen:
            return self
        m = CostModel(self.window)
        for key, median in self._median.items():
            m.table[key] = deque([median], maxlen=self.window)
        m._median = dict(self._median)
        return m  # `best` starts empty: the lowest medians are the path's own (its plain steps
        # may cost 3x the fast path's, and a borrowed best would weigh plain trials too low)

    def observe(self, n: int, budget: int, seconds: float, at: int | None = None) -> None:
        """One step's seconds; `at`: the controller's step index (marks the entry fresh)."""
        if seconds > 0 and not self.frozen:
            if at is not None:
                self.seen_at[(n, budget)] = at
            if (n, budget) not in self.table:
                self._nearest.clear()  # a new measured size: nearest sizes may change
                self._brackets.clear()
            q = self.table.setdefault((n, budget), deque(maxlen=self.window))
            q.append(seconds)
            med = self._median[(n, budget)] = statistics.median(q)
            if med < self.best.get((n, budget), float("inf")):
                self.best[(n, budget)] = med

    def median(self, n: int, budget: int) -> float | None:
        """The entry's own median (None: never measured at n; no interpolation nor borrowing)."""
        return self._median.get((n, budget))

    def overstated(self, n: int, budget: int) -> bool:
        """Whether the entry's median is BURST_FACTOR or more times the lowest it has held."""
        key = (n, budget)
        low, med = self.best.get(key), self._median.get(key)
        return low is not None and med is not None and med >= BURST_FACTOR * low

    def overstated_entries(self) -> dict[str, float]:
        """Every overstated entry, "n:budget" -> its median over its lowest (/server_info)."""
        return {f"{n}:{b}": round(self._median[(n, b)] / self.best[(n, b)], 2)
                for (n, b) in sorted(self._median) if self.overstated(n, b)}  # fmt: skip

    def restart(self, n: int, budget: int) -> None:
        """The entry's window cut to one sample, its median (a trial is about to measure it:
        its few steps then decide the median, not a full window of old ones, e.g. a burst's)."""
        key = (n, budget)
        if key in self._median and not self.frozen:
            self.table[key] = deque([self._median[key]], maxlen=self.window)

    def _interpolate(self, n: int, budget: int) -> float | None:
        """Linear in the batch size between the nearest measured sizes below and above n at
        this budget (a round's device work grows with batch x budget tokens); None when n is
        not between two measured sizes."""
        key = (n, budget)
        if key not in self._brackets:  # looked up once per table shape (read every step)
            below = max((m for m, b in self._median if b == budget and m < n), default=None)
            above = min((m for m, b in self._median if b == budget and m > n), default=None)
            self._brackets[key] = None if below is None or above is None else (below, above)
        if self._brackets[key] is None:
            return None
        below, above = self._brackets[key]
        lo, hi = self._median[(below, budget)], self._median[(above, budget)]
        return lo + (hi - lo) * (n - below) / (above - below)

    def clear(self) -> None:
        self.seen_at.clear()
        self.table.clear()
        self._median.clear()
        self.best.clear()
        self._nearest.clear()
        self._brackets.clear()

    def _value(self, key: tuple[int, int]) -> float | None:
        return self._median.get(key)

    def estimate(self, n: int, budget: int) -> float | None:
        own = self._value((n, budget))
        if own is not None:
            return own
        between = self._interpolate(n, budget)
        if between is not None:
            return between
        m = self._nearest.get((n, budget), -1)
        if m == -1:  # not looked up since the table last gained a key (read every step)
            sizes = [s for s, b in self.table if b == budget]
            m = min(sizes, key=lambda s: (abs(s - n), s)) if sizes else None
            self._nearest[(n, budget)] = m
        if m is None:
            return None
        base = self._value((m, budget))
        here, there = self._value((n, 0)), self._value((m, 0))
        if here is not None and there is not None:
            return base * here / there
        return base

    def curve(self, n: int = 1) -> dict[int, float]:
        """Seconds per step at batch size n, by budget (for /server_info)."""
        return {b: round(self._value((m, b)), 6) for (m, b) in sorted(self.table) if m == n}

    def mark_stale(self) -> None:
        """Every entry stale (kept as estimates): measured before serving, or long ago."""
        self.seen_at.clear()

    def lower_bound(self, n: int, budget: int, now: int, fresh_steps: int) -> float | None:
        """The largest fresh cost among budgets 1..`budget` at batch size n: what `budget` costs
        at least, by measurements no older than `fresh_steps` steps (None: none fresh). Budget
        0 runs another path (plain decoding, not launched ahead) and bounds nothing."""
        best = None
        for (m, b), at in self.seen_at.items():
            if m == n and 0 < b <= budget and now - at <= fresh_steps:
                c = self._median[(m, b)]
                best = c if best is None else max(best, c)
        return best

    def is_fresh(self, n: int, budget: int, now: int, fresh_steps: int) -> bool:
        at = self.seen_at.get((n, budget))
        return at is not None and now - at <= fresh_steps
