"""A rogue process of the same user that maps a tandem segment by name and writes garbage into
it, for the fault campaign (bench/faults/rogue.py) and the tests that keep its findings fixed.

`python -m harness.rogue MODE SEGMENT SEED [NEEDLE_HEX]` writes and prints what it wrote;
`scribble()` runs it as a separate process. Layouts are read from the segment itself
(shm/ring.py, shm/regions.py). So that a write lands where it is meant to, `stopped()` holds the
processes at both ends of the segment with SIGSTOP for the instant of the write, and `resume`
lets the reader go first (the writer would otherwise publish over a ring's garbage before it is
read); `resume_once_read` holds the writer until the ring's reader has had it.

Modes:
  ring-garbage  random bytes over the record area at the producer's head, and head moved past
                them: the consumer finds records that are not records
  ring-forge    one well-framed record (the length, kind and sequence number the consumer
                expects next) whose payload is random bytes, published after the real ones
  arena-data    the int32 prompt ids NEEDLE, found in the data area, overwritten by ids far
                outside any vocabulary
  arena-gen     the generation of the region holding NEEDLE bumped, as if it had been freed
  arena-table   random bytes over the whole region table (generations and orders)
  arena-header  random bytes over the segment and arena headers
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

import posix_ipc

from shm.reaper import scan
from shm.regions import ARENA_HEADER
from shm.ring import (
    CONSUMER_PID,
    CTL_OFF,
    DATA_OFF,
    FILLER,
    HEAD,
    READ_SEQ,
    RECORD,
    RING_HEADER,
    TAIL,
)
from shm.segment import HEADER_SIZE

GARBAGE_BYTES = 4096
# How long the reader runs alone after the write: more than a ring's sleep slice (0.1 s).
READER_HEAD_START_S = 0.3


def segments(pid: int, kind: str) -> list[str]:
    """The live segments of `kind` ("ring", "arena") that process `pid` owns, smallest first."""
    found = sorted(
        (e for e in scan() if e.alive and e.pid == pid and e.kind == kind), key=lambda e: e.size
    )
    return ["/" + e.path.name for e in found]


def scribble(mode: str, segment: str, seed: int, needle: bytes = b"") -> str:
    """Run the rogue as its own process; what it says it wrote."""
    args = [sys.executable, "-m", "harness.rogue", mode, segment, str(seed)]
    if needle:
        args.append(needle.hex())
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    return (done.stdout or done.stderr).strip()[-300:]


def stop(pids: Sequence[int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)


def resume(writer: int | None, readers: Sequence[int]) -> None:
    """The readers continue first, the writer a moment later (this call sleeps that moment)."""
    for pid in readers:
        os.kill(pid, signal.SIGCONT)
    if writer is not None:
        time.sleep(READER_HEAD_START_S)
        os.kill(writer, signal.SIGCONT)


def resume_once_read(writer: int, readers: Sequence[int], ring: str, timeout_s: float) -> None:
    """`resume`, the writer held until the ring's reader has read all that is published on it, or
    let go of it: a fixed head start can pass unused on a busy machine, and the writer would then
    publish over what the rogue wrote before it is read. TimeoutError if the reader does neither
    within `timeout_s` (the writer continues all the same)."""
    for pid in readers:
        os.kill(pid, signal.SIGCONT)
    try:
        read = _wait_read(ring, timeout_s)
    finally:
        os.kill(writer, signal.SIGCONT)
    if not read:
        raise TimeoutError(f"the reader of {ring} neither read it nor let it go in {timeout_s} s")


def _wait_read(ring: str, timeout_s: float) -> bool:
    mm = _map(ring)
    ctl = memoryview(mm)[CTL_OFF:DATA_OFF].cast("Q")
    try:
        deadline = time.monotonic() + timeout_s
        while ctl[CONSUMER_PID] and ctl[TAIL] < ctl[HEAD]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True
    finally:
        ctl.release()
        mm.close()


@contextlib.contextmanager
def stopped(writer: int | None, readers: Sequence[int]) -> Iterator[None]:
    """Both ends of a segment stopped while the block runs; then `resume`."""
    stop([*readers, *([writer] if writer is not None else [])])
    try:
        yield
    finally:
        resume(writer, readers)


def _next_seq(mm: mmap.mmap, cap: int, tail: int, head: int, seq: int) -> int:
    """The sequence number after the records still unread between tail and head."""
    while tail < head:
        pos = tail % cap
        n, kind, _ = RECORD.unpack_from(mm, DATA_OFF + pos)
        if kind == FILLER:
            tail += cap - pos
            continue
        tail += (RECORD.size + n + 15) & ~15
        seq += 1
    return seq


def _ring(mm: mmap.mmap, mode: str, rng: random.Random) -> str:
    cap, max_payload = RING_HEADER.unpack_from(mm, 64)
    ctl = memoryview(mm)[CTL_OFF:DATA_OFF].cast("Q")
    head, tail = ctl[HEAD], ctl[TAIL]
    pos = head % cap
    if mode == "ring-garbage":
        n = min(GARBAGE_BYTES, cap - pos)
        mm[DATA_OFF + pos : DATA_OFF + pos + n] = rng.randbytes(n)
        ctl[HEAD] = head + n
        return f"{n} random bytes at {pos}, head {head} -> {head + n}"
    seq = _next_seq(mm, cap, tail, head, ctl[READ_SEQ])
    payload = rng.randbytes(rng.randint(1, min(512, max_payload)))
    size = (RECORD.size + len(payload) + 15) & ~15
    if pos + size > cap:
        return "no room before the end of the lap; nothing written"
    RECORD.pack_into(mm, DATA_OFF + pos, len(payload), 0, seq)
    mm[DATA_OFF + pos + RECORD.size : DATA_OFF + pos + RECORD.size + len(payload)] = payload
    ctl[HEAD] = head + size
    return f"a record of {len(payload)} random bytes, seq {seq}, at {pos}"


def _arena(mm: mmap.mmap, mode: str, rng: random.Random, needle: bytes) -> str:
    block, n_blocks, gens_off, orders_off, data_off = ARENA_HEADER.unpack_from(mm, HEADER_SIZE)
    if mode == "arena-header":
        size = HEADER_SIZE + ARENA_HEADER.size
        mm[0:size] = rng.randbytes(size)
        return "random bytes over both headers"
    if mode == "arena-table":
        mm[gens_off : orders_off + n_blocks] = rng.randbytes(orders_off + n_blocks - gens_off)
        return f"random bytes over the table of {n_blocks} blocks"
    at = mm.find(needle, data_off)
    if at < 0:
        return "the prompt was not found; nothing written"
    if mode == "arena-data":
        mm[at : at + len(needle)] = b"\x7f\x7f\x7f\x7f" * (len(needle) // 4)
        return f"{len(needle) // 4} prompt ids at {at} overwritten"
    index = (at - data_off) // block
    gens = memoryview(mm)[gens_off:orders_off].cast("Q")
    gens[index] += 2
    return f"generation of block {index} bumped to {gens[index]}"


def _map(name: str) -> mmap.mmap:
    shm = posix_ipc.SharedMemory(name)
    mm = mmap.mmap(shm.fd, 0)
    shm.close_fd()
    return mm


def main(argv: list[str]) -> int:
    mode, name, seed = argv[0], argv[1], int(argv[2])
    needle = bytes.fromhex(argv[3]) if len(argv) > 3 else b""
    mm = _map(name)
    rng = random.Random(seed)
    print(_ring(mm, mode, rng) if mode.startswith("ring") else _arena(mm, mode, rng, needle))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
