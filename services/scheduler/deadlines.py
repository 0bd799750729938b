"""Deadlines of waiting and running requests, earliest first, so expiry never scans the queue.

Entries of requests that moved on (admitted, finished) are dropped lazily; a request may
have two entries after a preemption, and is reported once.
"""

from __future__ import annotations

import heapq

from services.scheduler.request import RequestState, Status


class _Heap:
    """The deadlines of requests in one of `statuses`; entries of the others are stale."""

    def __init__(self, *statuses: Status) -> None:
        self.statuses = statuses
        self.entries: list[tuple[float, int, RequestState]] = []

    def pop_until(self, until: float) -> list[RequestState]:
        """Requests whose deadline is at or before `until`."""
        heap = self.entries
        out: dict[int, RequestState] = {}
        while heap and heap[0][0] <= until:
            req = heapq.heappop(heap)[2]
            if req.status in self.statuses:
                # A request preempted and re-queued has two entries: report it once.
                out[id(req)] = req
        return list(out.values())

    def earliest(self) -> float | None:
        heap = self.entries
        while heap and heap[0][2].status not in self.statuses:
            heapq.heappop(heap)
        return heap[0][0] if heap else None


class Deadlines:
    def __init__(self) -> None:
        self.waiting = _Heap(Status.WAITING, Status.PREEMPTED)
        self.running = _Heap(Status.RUNNING)

    def add(self, req: RequestState) -> None:
        if req.deadline is not None:
            heap = self.running if req.status is Status.RUNNING else self.waiting
            heapq.heappush(heap.entries, (req.deadline, req.order, req))
