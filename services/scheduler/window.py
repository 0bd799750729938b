"""The micro-batch window: on an idle worker, hold admission briefly so arrivals share a step.

It is adaptive in two ways. It never holds while sequences are running (the next step is coming
anyway, and new arrivals join it). And it only holds when recent arrivals came closer together
than the window, i.e. when another request is likely to arrive before it closes; with sparse
traffic the window costs nothing.
"""

from __future__ import annotations

# Weight of the newest inter-arrival gap in the moving average.
_GAP_ALPHA = 0.2


class BatchWindow:
    def __init__(self, max_wait_s: float, max_seqs: int) -> None:
        self.max_wait_s = max_wait_s
        self.max_seqs = max_seqs
        # When the first request since the last admission arrived: the window runs from there.
        self.opened_at: float | None = None
        self._last_arrival: float | None = None
        self.mean_gap_s: float | None = None

    def on_arrival(self, now: float) -> None:
        if self._last_arrival is not None:
            gap = max(0.0, now - self._last_arrival)
            mean = self.mean_gap_s
            self.mean_gap_s = gap if mean is None else mean + _GAP_ALPHA * (gap - mean)
        self._last_arrival = now
        if self.opened_at is None:
            self.opened_at = now

    def holds(self, now: float, num_waiting: int, worker_busy: bool) -> bool:
        if self.max_wait_s <= 0 or worker_busy or self.opened_at is None:
            return False
        if num_waiting == 0 or num_waiting >= self.max_seqs:
            return False
        if self.mean_gap_s is None or self.mean_gap_s > self.max_wait_s:
            return False
        return now < self.opened_at + self.max_wait_s

    @property
    def closes_at(self) -> float | None:
        return None if self.opened_at is None else self.opened_at + self.max_wait_s

    def close(self) -> None:
        self.opened_at = None

    def reset(self) -> None:
        self.opened_at = None
        self._last_arrival = None
        self.mean_gap_s = None
