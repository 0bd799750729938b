"""A POSIX shared-memory segment: created 0600 under an unguessable name, owned by its creator.

Every segment starts with a 64-byte header (little-endian):

    offset size  field
    0      8     magic       b"TANDEMSH"; written last, so a half-made header never validates
    8      4     version     LAYOUT_VERSION; a reader of another layout refuses the segment
    12     4     kind        SegmentKind: what the bytes after the header are (arena, ring)
    16     8     owner_pid   the creator's pid, in the creator's pid namespace (for humans)
    24     8     size        bytes in the mapping, header included
    32     8     created_ns  wall clock at creation
    40     24    reserved    zero

Liveness: the creator holds an exclusive flock(2) on the segment's file for as long as it has the
segment open, and the kernel drops that lock when the creator dies, however it dies. Anyone can
ask "is the owner alive?" by trying a shared lock without blocking. Unlike kill(pid, 0) this is
immune to pid reuse and works between pid namespaces (containers that share only /dev/shm).
A forked child inherits the lock with the descriptor, so fork only before creating segments.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import mmap
import os
import re
import secrets
import struct
import time
import weakref
from collections.abc import Callable

import numpy as np
import posix_ipc

from shm.errors import ShmError

MAGIC = b"TANDEMSH"
LAYOUT_VERSION = 1
HEADER = struct.Struct("<8sIIQQQ24x")
HEADER_SIZE = HEADER.size  # 64
NAME_RE = re.compile(r"/tandem-(\d{1,10})-([0-9a-f]{16})")
PAGE = mmap.PAGESIZE


class SegmentKind(enum.IntEnum):
    ARENA = 1
    RING = 2


def check_name(name: object) -> str:
    """Only our own naming scheme reaches shm_open: no paths, no other programs' segments."""
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise ShmError(f"bad segment name {name!r} (expected /tandem-<pid>-<16 hex digits>)")
    return name


def lock_held(fd: int) -> bool:
    """True while another open file (the owner's) holds an exclusive flock on `fd`'s file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _release(name: str, shm: posix_ipc.SharedMemory, unlink: bool, creator_pid: int) -> None:
    # Runs from close(), garbage collection or interpreter exit; a forked child that inherited
    # this finalizer must not unlink its parent's segment.
    if unlink and os.getpid() == creator_pid:
        with contextlib.suppress(posix_ipc.ExistentialError):  # already reaped
            posix_ipc.unlink_shared_memory(name)
    shm.close_fd()


class Segment:
    """One mapped segment. The creator (`owner`) unlinks it on close; peers only unmap."""

    def __init__(
        self, name: str, shm: posix_ipc.SharedMemory, mm: mmap.mmap, owner: bool, kind: SegmentKind
    ) -> None:
        self.name = name
        self.owner = owner
        self.kind = kind
        self.size = len(mm)
        self.mm = mm
        self.pinned = False
        self._head = MAGIC + struct.pack("<II", LAYOUT_VERSION, kind)
        self._fd: int = shm.fd
        self._close_hooks: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(self, _release, name, shm, owner, os.getpid())

    @classmethod
    def create(cls, size: int, kind: SegmentKind) -> Segment:
        """A new segment of `size` bytes (header included, rounded up to whole pages)."""
        if size < HEADER_SIZE:
            raise ShmError(f"segment size {size} is smaller than its {HEADER_SIZE}-byte header")
        size = -(-size // PAGE) * PAGE
        # 64 random bits: another local user cannot guess a name to pre-create or attach to it.
        name = f"/tandem-{os.getpid()}-{secrets.token_hex(8)}"
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            os.fchmod(shm.fd, 0o600)  # whatever the umask was, the mode is exactly 0600
            os.set_inheritable(shm.fd, False)
            # Locked before the magic is written: a reaper that finds the lock free and the
            # magic present knows the owner died (see reaper.py).
            fcntl.flock(shm.fd, fcntl.LOCK_EX)
            mm = mmap.mmap(shm.fd, size)
            HEADER.pack_into(
                mm, 0, b"\0" * 8, LAYOUT_VERSION, kind, os.getpid(), size, time.time_ns()
            )
            mm[0:8] = MAGIC
        except BaseException:
            posix_ipc.unlink_shared_memory(name)
            shm.close_fd()
            raise
        return cls(name, shm, mm, owner=True, kind=kind)

    @classmethod
    def attach(cls, name: str, kind: SegmentKind) -> Segment:
        """Map an existing segment after checking its header; a bad one raises ShmError."""
        check_name(name)
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise ShmError(f"unknown segment {name} (never created, or already unlinked)") from None
        except posix_ipc.PermissionsError:
            raise ShmError(f"segment {name} belongs to another user") from None
        try:
            os.set_inheritable(shm.fd, False)
            size = os.fstat(shm.fd).st_size
            if size < HEADER_SIZE:
                raise ShmError(f"segment {name} is {size} bytes, too small for a header")
            mm = mmap.mmap(shm.fd, size)
            try:
                check_header(name, mm, kind)
            except ShmError:
                mm.close()
                raise
        except BaseException:
            shm.close_fd()
            raise
        return cls(name, shm, mm, owner=False, kind=kind)

    @property
    def owner_pid(self) -> int:
        return int(HEADER.unpack_from(self.mm, 0)[3])

    def owner_alive(self) -> bool:
        return self.owner or lock_held(self._fd)

    def check(self) -> None:
        """Re-validate the header: a segment scribbled over after attach is refused, not read."""
        if self.mm[:16] != self._head:  # magic, version, kind: one compare on the hot path
            check_header(self.name, self.mm, self.kind)

    def address(self) -> int:
        """Virtual address of the first byte of this process's mapping (for cudaHostRegister)."""
        probe = np.frombuffer(self.mm, dtype=np.uint8, count=1)
        return int(probe.ctypes.data)

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run `hook` before unmapping (page-locked memory must be unregistered first)."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        """Unmap; the owner also unlinks the name. Idempotent."""
        if not self._finalizer.alive:
            return
        hooks, self._close_hooks = self._close_hooks, []
        for hook in reversed(hooks):
            hook()
        self._finalizer()
        # If views over the mapping are still alive, unmapping now would turn them into
        # segfaults: it is unmapped instead when the last view is garbage collected.
        with contextlib.suppress(BufferError):
            self.mm.close()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.owner else "peer"
        return f"Segment({self.name}, {self.kind.name.lower()}, {self.size} bytes, {role})"


def check_header(name: str, mm: mmap.mmap, kind: SegmentKind) -> None:
    """Validate a mapped header (the mapping holds one: attach checked the size)."""
    magic, version, got_kind, _, size, _ = HEADER.unpack_from(mm, 0)
    if magic != MAGIC:
        raise ShmError(f"segment {name}: bad magic {magic!r}, not a tandem segment")
    if version != LAYOUT_VERSION:
        raise ShmError(
            f"segment {name}: layout version {version}, this reader speaks {LAYOUT_VERSION}"
        )
    if got_kind != kind:
        raise ShmError(f"segment {name}: holds kind {got_kind}, expected {kind.name.lower()}")
    if size != len(mm):
        raise ShmError(f"segment {name}: header says {size} bytes, mapping has {len(mm)}")
