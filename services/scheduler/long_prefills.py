"""The running long prefills, counted by priority.

The cap (`max_long_prefills`) applies among equal and higher priorities, so a long low-priority
prompt never holds back a long high-priority one, while a huge prompt still cannot hold back
prompts of its own level.
"""

from __future__ import annotations

from collections import Counter

from services.scheduler.request import RequestState


class LongPrefills:
    def __init__(self) -> None:
        self.by_priority: Counter[int] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_priority.values())

    def at_or_above(self, priority: int) -> int:
        return sum(n for p, n in self.by_priority.items() if p >= priority)

    def add(self, req: RequestState) -> None:
        req.long_prefill = True
        self.by_priority[req.priority] += 1

    def remove(self, req: RequestState) -> None:
        req.long_prefill = False
        self.by_priority[req.priority] -= 1
        if not self.by_priority[req.priority]:
            del self.by_priority[req.priority]
