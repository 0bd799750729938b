"""Which priorities are arriving: lower-priority prefill yields to a higher priority while
requests of it keep coming (`SchedulerConfig.lower_priority_prefill_tokens`).

A step cannot be taken back once the worker has it, so a high-priority request that arrives
waits for the step already running; keeping the steps that carry only lower-priority prefill
short bounds that wait. Whether to expect such arrivals is judged from the recent past: a
priority counts for `horizon_s` after its last arrival. A handful of levels are in use at most,
so every question here is O(levels).
"""

from __future__ import annotations


class PriorityTraffic:
    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        # priority -> clock time a request of it last arrived.
        self.last_arrival: dict[int, float] = {}

    def on_arrival(self, priority: int, now: float) -> None:
        self.last_arrival[priority] = now

    def top(self, now: float) -> int | None:
        """The highest priority still arriving, if a lower one is too (else nobody yields)."""
        recent, since = self.last_arrival, now - self.horizon_s
        for priority in [p for p, t in recent.items() if t < since]:
            del recent[priority]
        return max(recent) if len(recent) > 1 else None
