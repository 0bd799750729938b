"""The other process in cross-process tests, run as `python _shm_peer.py ROLE ARGS...`.

It prints what the test needs (names) one per line on stdout, then does its part. A peer that
owns segments holds them until its stdin closes, so the test decides when it exits.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import zlib
from pathlib import Path

from shm.arena import Arena
from shm.consumer import RingConsumer
from shm.producer import RingProducer

ROOT = Path(__file__).resolve().parents[2]
RECORD_HEAD = struct.Struct("<QI")  # seq, crc32 of the body
POOL = random.Random(1234).randbytes(1 << 16)


def make_record(seq: int, rng: random.Random, max_body: int) -> bytes:
    """A record whose seq and checksum let the consumer spot loss, duplicates and torn bytes."""
    n = rng.randrange(max_body + 1)
    start = (seq * 7919) % (len(POOL) - max_body)
    body = POOL[start : start + n]
    return RECORD_HEAD.pack(seq, zlib.crc32(body)) + body


def check_record(data: bytes, expected_seq: int) -> None:
    seq, crc = RECORD_HEAD.unpack_from(data)
    body = data[RECORD_HEAD.size :]
    if seq != expected_seq:
        raise AssertionError(f"record {seq} arrived where {expected_seq} was due")
    if zlib.crc32(body) != crc:
        raise AssertionError(f"record {seq} is torn: checksum mismatch")


def produce(count: int, capacity: int, max_body: int) -> None:
    """Stream `count` records (-1: forever) through a ring this process owns."""
    rng = random.Random(count)
    with RingProducer.create(capacity) as ring:
        print(ring.name, flush=True)
        seq = 0
        while seq != count:
            ring.put(make_record(seq, rng, max_body), timeout=30)
            seq += 1
        sys.stdin.read()  # the consumer has what it needs once the test closes our stdin


def hold() -> None:
    """Own an arena and a ring, print their names, wait for stdin to close; SIGTERM ends the
    process the way the services end on it: through the code that closes what it owns."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with Arena.create(1 << 20) as arena, RingProducer.create(1 << 16) as ring:
        print(arena.name, flush=True)
        print(ring.name, flush=True)
        sys.stdin.read()


def consume(name: str) -> None:
    """Attach as the consumer of ring `name`, say so, and wait (to be killed, typically)."""
    with RingConsumer.attach(name):
        print("attached", flush=True)
        sys.stdin.read()


class Peer:
    """This file run as a peer process: `lines(n)` reads what it printed."""

    def __init__(self, role: str, *args: object) -> None:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, role, *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    def lines(self, n: int) -> list[str]:
        assert self.proc.stdout is not None
        out = [self.proc.stdout.readline().strip() for _ in range(n)]
        assert all(out), f"peer exited early with {self.proc.wait()}"
        return out

    def finish(self, timeout: float = 30) -> int:
        """Close its stdin (its cue to exit normally) and wait."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    role, args = sys.argv[1], sys.argv[2:]
    if role == "produce":
        produce(*map(int, args))
    elif role == "hold":
        hold()
    elif role == "consume":
        consume(*args)
    else:
        raise SystemExit(f"unknown role {role}")
