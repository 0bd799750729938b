"""A bounded single-producer/single-consumer ring of variable-size records in shared memory.

It carries the per-step hot path (step descriptors, step results, token events) between two
processes with one copy in and one copy out, no syscall while both sides are busy, and a posix
named semaphore to wake a sleeping side. The producer creates and owns the ring; the consumer
attaches by name (two processes need only share /dev/shm: no fd passing, no common parent).

Byte layout (a segment of kind RING; little-endian u64 unless noted):

    offset  size  written by  field
    0       64    producer    segment header (segment.py)
    64      64    producer    ring header: C = bytes in the record area, max payload
    128     64    producer    head (bytes ever published) | space_wanted (1 while the producer
                              sleeps on "<name>.space")
    192     64    consumer    tail (bytes ever consumed) | data_wanted (1 while the consumer
                              sleeps on "<name>.data") | records consumed | consumer pid
    256     C     producer    record area: a record starts at (position mod C), never wraps

    one record, 16-byte aligned:
    +------------+----------+---------+------------------+-------------+
    | length u32 | kind u32 | seq u64 | payload (length) | pad to 16   |
    +------------+----------+---------+------------------+-------------+
    kind 0 = message; kind 1 = filler: the rest of the area is unused this lap, go to offset 0

Each control line is written by one side only: no locks, no shared read-modify-write.

State of a stretch of the record area:

          producer copies header+payload        producer stores head past it
    FREE ─────────────────────────────▶ WRITTEN ─────────────────────────────▶ PUBLISHED
     ▲     (at or past head: invisible)                                            │
     └────────────── consumer copies the payload out, then stores tail past it ◀───┘

head is the sequence number written last: every byte of a record is stored before head moves
past it (x86-64 keeps stores in order, and CPython does not reorder across calls), so a reader
never sees a torn record, and a producer killed mid-record leaves it invisible. The seq inside a
record is a check: the consumer knows which number comes next.

Wake-up (an eventcount; the full ring is the mirror image with tail, space_wanted, ".space"):

    consumer get()                                producer put()
      1 record at tail? take it                     a write record, store head
      2 spin up to spin_s re-reading head           b fence
      3 data_wanted = 1; fence                      c data_wanted? post ".data"
      4 record now? data_wanted = 0; take it
      5 wait on ".data" up to slice_s; goto 1
      5' slice passed, empty, producer dead? PeerGone

The fences order 3 before 4 and a before c: either the consumer sees the record in 4 or the
producer sees data_wanted in c. A surplus post only costs the waiter one more look.

Liveness: the producer owns the segment lock (segment.py); the consumer holds an exclusive flock
on the ".space" semaphore's file, which also keeps a second consumer out.

The ends live in producer.py (RingProducer) and consumer.py (RingConsumer); the waiting in
wakeup.py.
"""

from __future__ import annotations

import os
import struct
from typing import Self

import posix_ipc

from shm.errors import ShmError
from shm.segment import Segment

RING_HEADER = struct.Struct("<QQ48x")
RECORD = struct.Struct("<IIQ")
MESSAGE, FILLER = 0, 1
CTL_OFF, DATA_OFF = 128, 256
HEAD, SPACE_WANTED = 0, 1  # u64 indices into the control lines: the producer's line
TAIL, DATA_WANTED, READ_SEQ, CONSUMER_PID = 8, 9, 10, 11  # the consumer's line
# A producer usually answers within tens of microseconds when both ends are busy; spinning
# that long costs less than a futex sleep and wake-up (measured in bench/shm_transport.py).
DEFAULT_SPIN_S = 50e-6
# How long a sleeper waits before it checks that its peer is still alive.
DEFAULT_SLICE_S = 0.1


def sem_names(name: str) -> tuple[str, str]:
    """The ring's two semaphores: records published (".data") and space freed (".space")."""
    return f"{name}.data", f"{name}.space"


def lock_file(sem_name: str) -> int:
    # Linux keeps a named semaphore in /dev/shm/sem.<name>; its file carries the consumer's lock.
    return os.open(f"/dev/shm/sem.{sem_name[1:]}", os.O_RDONLY | os.O_CLOEXEC)


def record_size(n: int) -> int:
    return (RECORD.size + n + 15) & ~15


class Ring:
    """What both ends share: the mapped segment, the control words and the two semaphores."""

    lock_fd: int  # the ".space" semaphore's file, whose flock the consumer holds; set by each end

    def __init__(
        self, segment: Segment, sems: list[posix_ipc.Semaphore], spin_s: float, slice_s: float
    ) -> None:
        self.segment = segment
        self.name = segment.name
        self.capacity, self.max_payload = RING_HEADER.unpack_from(segment.mm, 64)
        if (
            self.capacity < 256
            or self.capacity % 64
            or DATA_OFF + self.capacity > segment.size
            or self.max_payload != self.capacity // 2 - RECORD.size
        ):
            raise ShmError(f"segment {self.name}: corrupt ring header")
        self.ctl = memoryview(segment.mm)[CTL_OFF:DATA_OFF].cast("Q")
        self.buf = memoryview(segment.mm)[DATA_OFF : DATA_OFF + self.capacity]
        self.sems = sems
        self.spin_s, self.slice_s = spin_s, slice_s
        self.closed = False

    def check_open(self) -> None:
        if self.closed:
            raise ShmError(f"ring {self.name} is closed")

    def close(self) -> None:
        """Close the semaphores, lock file and views, then the segment (an owner's also unlinks)."""
        self.closed = True
        for sem in self.sems:
            sem.close()
        os.close(self.lock_fd)
        self.ctl.release()
        self.buf.release()
        self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
