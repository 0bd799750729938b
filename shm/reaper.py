"""Finding shared memory whose owner died, and unlinking it: segments and their rings' semaphores.

A segment file `tandem-<pid>-<hex>` is dead when its header is complete and nobody holds its
owner lock (segment.py). The owner takes the lock before it writes the magic, so "magic present,
then lock free" (read in that order) proves the owner is gone, even across pid namespaces and
after pid reuse. A segment without its magic is being created right now, or its creator died
within microseconds of creating it: it is reaped only once it is older than GRACE_S.
A semaphore `sem.tandem-<pid>-<hex>.<data|space>` lives and dies with the segment of that name
(the ring creates the segment first and unlinks it first), so one without a live segment goes.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from shm.segment import HEADER, HEADER_SIZE, MAGIC, SegmentKind, lock_held

DEV_SHM = Path("/dev/shm")
SEGMENT_RE = re.compile(r"tandem-(\d{1,10})-[0-9a-f]{16}")
SEMAPHORE_RE = re.compile(r"sem\.(tandem-(\d{1,10})-[0-9a-f]{16})\.(?:data|space)")
GRACE_S = 10.0


@dataclass(frozen=True)
class Entry:
    path: Path
    kind: str  # "arena", "ring", "semaphore", or "unknown" for a segment without a valid header
    size: int  # bytes
    pid: int  # the creator's pid, from the name (in the creator's pid namespace)
    alive: bool
    age_s: float


def _segment(path: Path, pid: int, now: float) -> Entry | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        stat = os.fstat(fd)
        header = os.pread(fd, HEADER_SIZE, 0)  # before the lock test: see the docstring
        held = lock_held(fd)
    finally:
        os.close(fd)
    age = now - stat.st_mtime
    complete = len(header) == HEADER_SIZE and header[:8] == MAGIC
    kind = "unknown"
    if complete:
        with contextlib.suppress(ValueError):
            kind = SegmentKind(HEADER.unpack(header)[2]).name.lower()
    alive = held or (not complete and age < GRACE_S)
    return Entry(path, kind, stat.st_size, pid, alive, age)


def scan(root: Path = DEV_SHM) -> list[Entry]:
    """Every tandem segment and semaphore under `root`, with whether its owner is alive."""
    now = time.time()
    segments: dict[str, Entry] = {}
    semaphores: list[tuple[Path, str, int]] = []
    for path in sorted(root.iterdir()):
        if match := SEGMENT_RE.fullmatch(path.name):
            entry = _segment(path, int(match[1]), now)
            if entry is not None:
                segments[path.name] = entry
        elif match := SEMAPHORE_RE.fullmatch(path.name):
            semaphores.append((path, match[1], int(match[2])))
    entries = list(segments.values())
    for path, segment_name, pid in semaphores:
        with contextlib.suppress(FileNotFoundError):
            stat = path.stat()
            owner = segments.get(segment_name)
            alive = owner is not None and owner.alive
            entries.append(Entry(path, "semaphore", stat.st_size, pid, alive, now - stat.st_mtime))
    return entries


def reap(root: Path = DEV_SHM, *, dry_run: bool = False) -> list[Entry]:
    """Unlink every dead entry under `root`, segments first; returns what was (or would be) removed.

    Processes still mapping a reaped segment keep their mapping: only the name goes.
    """
    dead = [entry for entry in scan(root) if not entry.alive]
    if not dry_run:
        for entry in dead:
            with contextlib.suppress(FileNotFoundError):
                entry.path.unlink()
    return dead
