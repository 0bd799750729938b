"""Deadlines of waiting and running requests, earliest first, so expiry never scans the queue.

Entries of requests that moved on (admitted, finished) are dropped lazily; a request may
have two entries after a preemption, and is reported once.
"""

from __future__ import annotations

import heapq

from services.scheduler.request import RequestState, Status

_WAITING = (Status.WAITING, Status.PREEMPTED)


class Deadlines:
    def __init__(self) -> None:
        self._waiting: list[tuple[float, int, RequestState]] = []
        self._running: list[tuple[float, int, RequestState]] = []

    def add(self, req: RequestState) -> None:
        if req.deadline is None:
            return
        heap = self._running if req.status is Status.RUNNING else self._waiting
        heapq.heappush(heap, (req.deadline, req.order, req))

    def pop_waiting(self, until: float) -> list[RequestState]:
        """Waiting requests whose deadline is at or before `until`."""
        return self._pop(self._waiting, until, _WAITING)

    def pop_running(self, until: float) -> list[RequestState]:
        return self._pop(self._running, until, (Status.RUNNING,))

    def next_waiting(self) -> float | None:
        return self._next(self._waiting, _WAITING)

    def next_running(self) -> float | None:
        return self._next(self._running, (Status.RUNNING,))

    def clear(self) -> None:
        self._waiting.clear()
        self._running.clear()

    @staticmethod
    def _pop(
        heap: list[tuple[float, int, RequestState]], until: float, statuses: tuple[Status, ...]
    ) -> list[RequestState]:
        out: dict[int, RequestState] = {}
        while heap and heap[0][0] <= until:
            req = heapq.heappop(heap)[2]
            if req.status in statuses:
                # A request preempted and re-queued has two entries: report it once.
                out[id(req)] = req
        return list(out.values())

    @staticmethod
    def _next(
        heap: list[tuple[float, int, RequestState]], statuses: tuple[Status, ...]
    ) -> float | None:
        while heap and heap[0][2].status not in statuses:
            heapq.heappop(heap)
        return heap[0][0] if heap else None
