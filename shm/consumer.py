"""The reading end of a ring (layout and protocol in ring.py): it attaches by name."""

from __future__ import annotations

import asyncio
import fcntl
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor

import posix_ipc

from shm import wakeup
from shm.errors import ShmError
from shm.ring import (
    CONSUMER_PID,
    DATA_WANTED,
    DEFAULT_SLICE_S,
    DEFAULT_SPIN_S,
    FILLER,
    HEAD,
    MESSAGE,
    READ_SEQ,
    RECORD,
    SPACE_WANTED,
    TAIL,
    Ring,
    lock_file,
    record_size,
    sem_names,
)
from shm.segment import Segment, SegmentKind


class RingConsumer(Ring):
    """The reading end: attaches to a producer's ring by name. Not to be shared between threads."""

    def __init__(
        self,
        segment: Segment,
        sems: list[posix_ipc.Semaphore],
        lock_fd: int,
        spin_s: float,
        slice_s: float,
    ) -> None:
        super().__init__(segment, sems, spin_s, slice_s)
        self.lock_fd = lock_fd
        self._tail = self.ctl[TAIL]  # resume where a previous consumer stopped
        self._seq = self.ctl[READ_SEQ]
        self._executor: ThreadPoolExecutor | None = None
        self.ctl[CONSUMER_PID] = os.getpid()

    @classmethod
    def attach(
        cls, name: str, *, spin_s: float = DEFAULT_SPIN_S, slice_s: float = DEFAULT_SLICE_S
    ) -> RingConsumer:
        segment = Segment.attach(name, SegmentKind.RING)
        sems: list[posix_ipc.Semaphore] = []
        lock_fd = -1
        try:
            for sem_name in sem_names(name):
                sems.append(posix_ipc.Semaphore(sem_name))
            lock_fd = lock_file(sem_names(name)[1])
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ShmError(f"ring {name} already has a consumer") from None
            return cls(segment, sems, lock_fd, spin_s, slice_s)
        except posix_ipc.ExistentialError:
            raise ShmError(f"ring {name} has lost its semaphores (producer gone?)") from None
        except BaseException:
            for sem in sems:
                sem.close()
            if lock_fd >= 0:
                os.close(lock_fd)
            segment.close()
            raise

    def _ready(self) -> bool:
        return self.closed or self.ctl[HEAD] != self._tail

    def try_get(self) -> bytes | None:
        """The next record if one is published, else None. Never blocks."""
        self.check_open()
        ctl, tail, cap = self.ctl, self._tail, self.capacity
        head = ctl[HEAD]
        if head == tail:
            return None
        pos = tail % cap
        n, kind, seq = RECORD.unpack_from(self.buf, pos)
        if kind == FILLER:
            tail += cap - pos
            pos = 0
            n, kind, seq = RECORD.unpack_from(self.buf, 0)
        size = record_size(n)
        if (
            kind != MESSAGE
            or seq != self._seq
            or n > self.max_payload
            or pos + size > cap
            or tail + size > head
        ):
            raise ShmError(f"ring {self.name}: corrupt record at {pos} (seq {seq}, {n} bytes)")
        data = bytes(self.buf[pos + RECORD.size : pos + RECORD.size + n])
        self._tail = tail + size
        self._seq = seq + 1
        ctl[READ_SEQ] = self._seq
        ctl[TAIL] = self._tail  # the payload is copied out: the producer may reuse the space
        wakeup.fence()
        if ctl[SPACE_WANTED]:
            self.sems[1].release()
        return data

    def _wait_data(self, timeout: float | None, spin_s: float) -> bool:
        deadline = math.inf if timeout is None else time.perf_counter() + timeout
        return wakeup.wait(
            self.ctl,
            DATA_WANTED,
            self.sems[0],
            self._ready,
            deadline,
            spin_s,
            self.slice_s,
            self.segment.owner_alive,
            "producer",
        )

    def get(self, timeout: float | None = None) -> bytes:
        """The next record, waiting up to `timeout` s (TimeoutError); PeerGone once drained."""
        deadline = math.inf if timeout is None else time.perf_counter() + timeout
        while (data := self.try_get()) is None:
            if not self._wait_data(deadline - time.perf_counter(), self.spin_s):
                raise TimeoutError(f"no record on ring {self.name} within {timeout} s")
        return data

    async def get_async(self, timeout: float | None = None) -> bytes:
        """`get` for asyncio: the waiting happens on a helper thread, the event loop runs on.

        The helper only waits for a record to be published; the record is taken on the event
        loop's thread, so a cancelled call loses nothing.
        """
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout is None else loop.time() + timeout
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ring{self.name}")
        while (data := self.try_get()) is None:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"no record on ring {self.name} within {timeout} s")
            # One slice at a time: a cancelled caller leaves its helper busy for one slice at most.
            await loop.run_in_executor(
                self._executor, self._wait_data, min(remaining, self.slice_s), 0.0
            )
        return data

    def close(self) -> None:
        """Unmap and let go of the consumer lock; the producer's names are the producer's."""
        if self.closed:
            return
        self.closed = True
        if self._executor is not None:
            self.sems[0].release()  # wake a helper blocked in sem_wait before unmapping it
            self._executor.shutdown(wait=True)
        self.ctl[CONSUMER_PID] = 0
        super().close()
