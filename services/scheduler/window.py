"""The micro-batch window: on an idle worker, hold admission briefly so arrivals share a step.

It is adaptive in two ways. It never holds while sequences are running (the next step is coming
anyway, and new arrivals join it). And it only holds when another arrival is more likely than
not before it closes: when most recent inter-arrival gaps (a moving average) were shorter than
the window. Bursts are batched; sparse traffic pays nothing.
"""

from __future__ import annotations

# Weight of the newest inter-arrival gap in the moving average.
_GAP_ALPHA = 0.2
# Hold only if at least this share of recent gaps would have fit in the window.
_MIN_SHORT_GAPS = 0.5


class BatchWindow:
    def __init__(self, max_wait_s: float, max_seqs: int) -> None:
        self.max_wait_s = max_wait_s
        self.max_seqs = max_seqs
        # When the first request since the last admission arrived: the window runs from there.
        self.opened_at: float | None = None
        self._last_arrival: float | None = None
        # Moving average of "the gap before this arrival was shorter than the window".
        self.short_gap_share: float | None = None

    def on_arrival(self, now: float) -> None:
        if self._last_arrival is not None:
            short = 1.0 if now - self._last_arrival <= self.max_wait_s else 0.0
            share = self.short_gap_share
            self.short_gap_share = short if share is None else share + _GAP_ALPHA * (short - share)
        self._last_arrival = now
        if self.opened_at is None:
            self.opened_at = now

    def holds(self, now: float, num_waiting: int, worker_busy: bool) -> bool:
        if self.max_wait_s <= 0 or worker_busy or self.opened_at is None:
            return False
        if num_waiting == 0 or num_waiting >= self.max_seqs:
            return False
        if self.short_gap_share is None or self.short_gap_share < _MIN_SHORT_GAPS:
            return False
        return now < self.opened_at + self.max_wait_s

    @property
    def closes_at(self) -> float | None:
        return None if self.opened_at is None else self.opened_at + self.max_wait_s

    def close(self) -> None:
        self.opened_at = None
