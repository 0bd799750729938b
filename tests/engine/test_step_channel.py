"""The shared-memory channel rank 0 hands steps to the other ranks through: every reader gets
every message in order, whatever its size, and a writer never overruns a slow reader."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from engine.errors import RankGroupError
from engine.step_channel import SLOT_BYTES, SLOTS, StepChannel


def test_readers_get_every_message_in_order_even_when_it_spans_slots() -> None:
    channel = StepChannel(multiprocessing.get_context("spawn"), readers=2)
    messages = [("step", list(range(n))) for n in (0, 3, 5 * SLOT_BYTES // 8)]  # last: ~5 slots
    messages += [("release", [i]) for i in range(3 * SLOTS)]  # laps the ring three times
    got: list[list[object]] = [[], []]

    def read(index: int) -> None:
        reader = channel.reader(index)
        got[index] = [reader.get() for _ in messages]

    threads = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    writer = channel.writer(lambda: None)
    for message in messages:
        writer.put(message)
    for t in threads:
        t.join(timeout=30)
    assert got == [messages, messages]


def test_a_writer_ahead_of_a_gone_reader_says_so() -> None:
    channel = StepChannel(multiprocessing.get_context("spawn"), readers=1)

    def gone() -> None:
        raise RankGroupError("rank 1 died")

    writer = channel.writer(gone)
    for i in range(SLOTS):  # the ring holds this many unread
        writer.put(i)
    with pytest.raises(RankGroupError, match="rank 1 died"):
        writer.put("one too many")
    with pytest.raises(TimeoutError):
        channel.writer(lambda: None).put("at close", timeout_s=0.1)
