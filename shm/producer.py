"""The writing end of a ring (layout and protocol in ring.py): it creates the ring and owns it."""

from __future__ import annotations

import contextlib
import math
import os
import time
import weakref

import posix_ipc

from shm import wakeup
from shm.errors import ShmError
from shm.ring import (
    CONSUMER_PID,
    DATA_OFF,
    DATA_WANTED,
    DEFAULT_SLICE_S,
    DEFAULT_SPIN_S,
    FILLER,
    HEAD,
    MESSAGE,
    RECORD,
    RING_HEADER,
    SPACE_WANTED,
    TAIL,
    Ring,
    lock_file,
    record_size,
    sem_names,
)
from shm.segment import Segment, SegmentKind, lock_held


def _unlink_sems(names: tuple[str, ...], creator_pid: int) -> None:
    if os.getpid() != creator_pid:
        return  # a forked child must not unlink its parent's semaphores
    for sem_name in names:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore(sem_name)


class RingProducer(Ring):
    """The writing end; it creates the ring and unlinks it (segment and semaphores) on close."""

    def __init__(
        self,
        segment: Segment,
        sems: list[posix_ipc.Semaphore],
        consumer_lock: int,
        finalizer: weakref.finalize,
        spin_s: float,
        slice_s: float,
    ) -> None:
        super().__init__(segment, sems, spin_s, slice_s)
        self.lock_fd = consumer_lock
        self._finalizer = finalizer
        self._head = 0  # == ctl[HEAD]; only this process moves it
        self._seq = 0

    @classmethod
    def create(
        cls,
        capacity: int = 1 << 20,
        *,
        spin_s: float = DEFAULT_SPIN_S,
        slice_s: float = DEFAULT_SLICE_S,
    ) -> RingProducer:
        """A ring whose record area holds `capacity` bytes; payloads up to capacity/2 - 16."""
        if capacity < 256 or capacity % 64:
            raise ShmError(f"ring capacity {capacity} must be a multiple of 64, at least 256")
        segment = Segment.create(DATA_OFF + capacity, SegmentKind.RING)
        RING_HEADER.pack_into(segment.mm, 64, capacity, capacity // 2 - RECORD.size)
        names = sem_names(segment.name)
        finalizer = weakref.finalize(segment, _unlink_sems, names, os.getpid())
        try:
            sems = [posix_ipc.Semaphore(n, posix_ipc.O_CREX, mode=0o600) for n in names]
            consumer_lock = lock_file(names[1])
        except BaseException:
            finalizer()
            segment.close()
            raise
        return cls(segment, sems, consumer_lock, finalizer, spin_s, slice_s)

    def _consumer_alive(self) -> bool:
        # Before any consumer attached, a full ring is waiting for one, not for a dead one.
        return not self.ctl[CONSUMER_PID] or lock_held(self.lock_fd)

    def _placement(self, size: int) -> tuple[int, int] | None:
        """(position, filler bytes) for a record of `size` bytes, or None while it does not fit."""
        cap, head = self.capacity, self._head
        pos = head % cap
        filler = cap - pos if size > cap - pos else 0
        tail = self.ctl[TAIL]
        if tail > head:
            # The consumer took records this end never published: someone else wrote them.
            raise ShmError(f"ring {self.name}: read up to {tail}, only {head} published (corrupt)")
        if head + filler + size - tail > cap:
            return None
        return pos, filler

    def try_put(self, payload: bytes | bytearray | memoryview) -> bool:
        """Append one record if there is room now; False if the ring is full."""
        self.check_open()
        if not isinstance(payload, bytes | bytearray):
            payload = memoryview(payload).cast("B")
        n = len(payload)
        if n > self.max_payload:
            raise ShmError(f"record of {n} bytes exceeds ring {self.name}'s {self.max_payload}")
        size = record_size(n)
        placement = self._placement(size)
        if placement is None:
            return False
        pos, filler = placement
        seq, buf = self._seq, self.buf
        if filler:
            RECORD.pack_into(buf, pos, 0, FILLER, seq)
            pos = 0
        RECORD.pack_into(buf, pos, n, MESSAGE, seq)
        buf[pos + RECORD.size : pos + RECORD.size + n] = payload
        self._head += filler + size
        self._seq = seq + 1
        self.ctl[HEAD] = self._head  # the publish: every byte of the record is stored before it
        wakeup.fence()
        if self.ctl[DATA_WANTED]:
            self.sems[0].release()
        return True

    def put(self, payload: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Append one record, waiting for room; TimeoutError after `timeout` seconds."""
        if self.try_put(payload):
            return
        deadline = math.inf if timeout is None else time.perf_counter() + timeout
        size = record_size(memoryview(payload).nbytes)
        while wakeup.wait(
            self.ctl,
            SPACE_WANTED,
            self.sems[1],
            lambda: self._placement(size) is not None,
            deadline,
            self.spin_s,
            self.slice_s,
            self._consumer_alive,
            "consumer",
        ):
            if self.try_put(payload):
                return
        raise TimeoutError(f"ring {self.name} stayed full for {timeout} s")

    def close(self) -> None:
        """Unlink the ring's names and unmap. A consumer drains what was published, then stops."""
        if self.closed:
            return
        self._finalizer()
        super().close()
