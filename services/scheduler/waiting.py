"""The waiting queue: requests in order of effective priority, aging included, in one heap.

Aging is linear and the same for every waiting request, so their order never changes while
they wait: a request's effective priority at time t is

    priority + aging_per_s * (waited_s + t - enqueue_time)  =  key + aging_per_s * t

with a key fixed at enqueue time. A heap on that key is exact without re-sorting anything, and
FCFS inside a level falls out of it (an earlier enqueue has a larger key). Requests that leave
by cancellation or expiry stay in the heap as stale entries and are dropped when they surface.
"""

from __future__ import annotations

import heapq

from services.scheduler.request import RequestState, Status

_WAITING = (Status.WAITING, Status.PREEMPTED)


class WaitingQueue:
    def __init__(self, aging_per_s: float) -> None:
        self.aging_per_s = aging_per_s
        # (-key, order, request): the smallest tuple is the request to admit next.
        self._heap: list[tuple[float, int, RequestState]] = []
        self.count = 0
        # Tokens the waiting requests would prefill: the second backpressure bound.
        self.num_tokens = 0

    def push(self, req: RequestState) -> None:
        key = req.priority + self.aging_per_s * (req.waited_s - req.enqueue_time)
        heapq.heappush(self._heap, (-key, req.order, req))
        self.count += 1
        self.num_tokens += len(req.token_ids)

    def peek(self) -> RequestState | None:
        heap = self._heap
        while heap and heap[0][2].status not in _WAITING:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> RequestState:
        req = self.peek()
        if req is None:
            raise IndexError("pop from an empty waiting queue")
        heapq.heappop(self._heap)
        self.discard(req)
        return req

    def discard(self, req: RequestState) -> None:
        """Account for a waiting request leaving; a stale heap entry is dropped when it surfaces."""
        self.count -= 1
        self.num_tokens -= len(req.token_ids)

    def live(self) -> list[RequestState]:
        return [entry[2] for entry in self._heap if entry[2].status in _WAITING]
