"""Rank 0 → the other ranks of a tensor-parallel group: each message (a step, a release) once,
through shared memory.

Why not a broadcast over torch.distributed: on CUDA that is NCCL, which moves device tensors,
so a step's few hundred bytes would cross to a GPU and back before a follower could launch
anything (a host sync per step on every rank); gloo would add a second process group and a
loopback TCP round for every step, and neither carries Python objects of varying size. Here a
message is pickled into memory every rank maps, and a semaphore wakes each reader: a few
microseconds, and nothing on the GPUs. (DESIGN.md: the ranks get each step over shared memory.)

Layout: SLOTS slots of SLOT_BYTES, each `u32 length | u8 more | payload`; a message is cut into
chunks, one a slot, `more` set on all but its last. Per reader r, `free[r]` counts the slots r
has done with (SLOTS at first) and `filled[r]` the slots written for r and not yet read (0):

    writer, per chunk: take free[r] for every r → write the slot → give filled[r] for every r
    reader, per chunk: take filled[r] → copy the slot out → give free[r]

so the writer never overwrites a slot a reader has not read, nor a reader reads one not yet
written; every reader reads every message, in order. The memory and the semaphores come from a
multiprocessing context and reach the readers as arguments of the processes it starts.
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Callable
from multiprocessing.context import SpawnContext
from typing import Any

SLOTS = 8
SLOT_BYTES = 1 << 20
_HEADER = struct.Struct("<IB")  # length, more
_CHUNK = SLOT_BYTES - _HEADER.size
TICK_S = 0.5  # how often a blocked writer asks whether its readers are still there


class StepChannel:
    def __init__(self, ctx: SpawnContext, readers: int) -> None:
        self.memory = ctx.RawArray("B", SLOTS * SLOT_BYTES)
        self.free = [ctx.Semaphore(SLOTS) for _ in range(readers)]
        self.filled = [ctx.Semaphore(0) for _ in range(readers)]

    def writer(self, alive: Callable[[], None]) -> ChannelWriter:
        """alive: raises when a reader is gone (called while the writer waits for one)."""
        return ChannelWriter(self, alive)

    def reader(self, index: int) -> ChannelReader:
        return ChannelReader(self, index)


class ChannelWriter:
    def __init__(self, channel: StepChannel, alive: Callable[[], None]) -> None:
        self.channel, self.alive = channel, alive
        self.view = memoryview(channel.memory).cast("B")
        self.next = 0  # the slot the next chunk goes to

    def put(self, message: Any, timeout_s: float | None = None) -> None:
        """Raises TimeoutError if a reader has not made room within timeout_s (None: wait as
        long as the readers are alive)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for start in range(0, max(len(data), 1), _CHUNK):
            chunk = data[start : start + _CHUNK]
            for free in self.channel.free:
                while not free.acquire(timeout=TICK_S):
                    self.alive()
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"a reader made no room in {timeout_s} s")
            offset = self.next * SLOT_BYTES
            _HEADER.pack_into(self.view, offset, len(chunk), start + _CHUNK < len(data))
            body = offset + _HEADER.size
            self.view[body : body + len(chunk)] = chunk
            self.next = (self.next + 1) % SLOTS
            for filled in self.channel.filled:
                filled.release()


class ChannelReader:
    def __init__(self, channel: StepChannel, index: int) -> None:
        self.free, self.filled = channel.free[index], channel.filled[index]
        self.view = memoryview(channel.memory).cast("B")
        self.next = 0

    def get(self) -> Any:
        """The next message; waits for as long as it takes (a rank idles between requests)."""
        parts = []
        more = True
        while more:
            self.filled.acquire()
            offset = self.next * SLOT_BYTES
            length, more = _HEADER.unpack_from(self.view, offset)
            body = offset + _HEADER.size
            parts.append(bytes(self.view[body : body + length]))
            self.next = (self.next + 1) % SLOTS
            self.free.release()
        return pickle.loads(b"".join(parts))
