"""Who unlinks what, when: one owner per process closes its segments however the process ends.

    normal exit of the `with` block ──▶ close() ──▶ every adopted arena/ring closes (unlinks)
    interpreter exit (atexit)        ──▶ close()
    SIGTERM (default handling)       ──▶ close(), then the previous handler, or death by SIGTERM
    SIGKILL, crash                   ──▶ nothing runs: the reaper (reaper.py) cleans up later

Segments and rings also unlink themselves when garbage collected or at interpreter exit (a
weakref finalizer each); the owner adds the signal, and one place to close everything in order.
An asyncio service that installs its own SIGTERM handler (loop.add_signal_handler) replaces this
one; its shutdown path then leaves the `with` block, which closes everything the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
from types import FrameType
from typing import Any, Protocol, TypeVar

from shm.arena import Arena
from shm.producer import RingProducer
from shm.reaper import reap


class Closable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closable)


class ShmOwner:
    """Creates and adopts this process's shared-memory objects and closes them, newest first."""

    def __init__(self, *, handle_sigterm: bool = True, reap_on_start: bool = False) -> None:
        self._objects: list[Closable] = []
        self._lock = threading.RLock()  # re-entered when SIGTERM lands inside adopt()
        self._pid = os.getpid()
        self._previous: Any = None
        self._installed = False
        self._closing = False
        self._terminate = False
        if reap_on_start:
            reap()
        atexit.register(self.close)
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            if previous is not signal.SIG_IGN:
                self._previous = previous
                signal.signal(signal.SIGTERM, self._on_sigterm)
                self._installed = True

    def adopt(self, obj: C) -> C:
        """Close `obj` with the others (a Reader, a RingConsumer, a Segment...)."""
        with self._lock:
            self._objects.append(obj)
        return obj

    def arena(self, capacity: int, *, block: int = 256) -> Arena:
        return self.adopt(Arena.create(capacity, block=block))

    def ring(self, capacity: int = 1 << 20, **kwargs: float) -> RingProducer:
        return self.adopt(RingProducer.create(capacity, **kwargs))

    def close(self) -> None:
        """Close everything adopted, newest first. Idempotent; safe from a signal handler."""
        if os.getpid() != self._pid:
            return  # a forked child does not own its parent's segments
        with self._lock:
            self._closing = True
            objects, self._objects = self._objects, []
        try:
            for obj in reversed(objects):
                with contextlib.suppress(Exception):  # one failed close must not strand the rest
                    obj.close()
        finally:
            self._closing = False
        if self._installed and threading.current_thread() is threading.main_thread():
            self._installed = False
            if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                signal.signal(signal.SIGTERM, self._previous)
        atexit.unregister(self.close)
        if self._terminate:
            self._terminate = False
            self._chain(signal.SIGTERM, None)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._closing:
            self._terminate = True  # let the close in progress finish, then act on the signal
            return
        self.close()
        self._chain(signum, frame)

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        else:  # SIG_DFL: die of SIGTERM as if we had never been here
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def __enter__(self) -> ShmOwner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
