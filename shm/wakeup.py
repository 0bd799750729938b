"""Waiting for the other end of a ring: spin briefly, then sleep on a posix named semaphore.

This is steps 2-5 of the wake-up protocol drawn in ring.py, written once for both directions.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import posix_ipc

from shm.errors import PeerGone

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier: acquiring a lock is a locked read-modify-write (store->load too)."""
    _fence_lock.acquire()
    _fence_lock.release()


def wait(
    ctl: memoryview,
    flag: int,
    sem: posix_ipc.Semaphore,
    ready: Callable[[], bool],
    deadline: float,
    spin_s: float,
    slice_s: float,
    peer_alive: Callable[[], bool],
    peer: str,
) -> bool:
    """Block until `ready()` (True) or `deadline` on perf_counter (False).

    `ctl[flag]` is this side's "wake me" word; `sem` is what the other side posts when it sees
    it set. Raises PeerGone when a slice passes unready and `peer_alive()` says no.
    """
    clock = time.perf_counter
    stop_spin = min(clock() + spin_s, deadline)
    while clock() < stop_spin:
        if ready():
            return True
        # On a machine with fewer free cores than runnable processes, a pure spin would hold
        # the core the peer needs to answer; yielding lets it run and costs ~1 µs when idle.
        os.sched_yield()
    while True:
        ctl[flag] = 1
        fence()
        if ready():
            ctl[flag] = 0
            return True
        remaining = deadline - clock()
        if remaining <= 0:
            ctl[flag] = 0
            return False
        try:
            sem.acquire(min(remaining, slice_s))
            woken = True
        except posix_ipc.BusyError:
            woken = False
        except posix_ipc.SignalError:
            # A signal with a Python handler interrupted the wait; the handler runs as soon as
            # we are back in the interpreter, then we look again.
            woken = True
        ctl[flag] = 0
        if ready():
            return True
        if not woken and not peer_alive():
            raise PeerGone(f"the {peer} of this ring is gone (it exited or closed the ring)")
