"""Rings within one process: order, wrap-around, full and empty rings, timeouts, asyncio."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shm.consumer import RingConsumer
from shm.errors import ShmError
from shm.producer import RingProducer
from shm.ring import HEAD, MESSAGE, RECORD, record_size

Ends = tuple[RingProducer, RingConsumer]


@pytest.fixture
def ring() -> Iterator[Ends]:
    with (
        RingProducer.create(1024, slice_s=0.02) as producer,
        RingConsumer.attach(producer.name, slice_s=0.02) as consumer,
    ):
        yield producer, consumer


def test_records_arrive_in_order_across_many_wraps(ring: Ends) -> None:
    producer, consumer = ring
    sent = [bytes([i % 251]) * (i * 37 % (producer.max_payload + 1)) for i in range(3000)]
    got: list[bytes] = []
    for payload in sent:
        while not producer.try_put(payload):
            item = consumer.try_get()
            assert item is not None  # the ring is only full while records wait
            got.append(item)
    while (item := consumer.try_get()) is not None:
        got.append(item)
    assert got == sent


def test_empty_ring_try_get_is_none_and_get_times_out(
    ring: Ends,
) -> None:
    _, consumer = ring
    assert consumer.try_get() is None
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        consumer.get(timeout=0.05)
    assert time.perf_counter() - start >= 0.05


def test_full_ring_refuses_then_accepts(ring: Ends) -> None:
    producer, consumer = ring
    record = b"x" * 100
    count = 0
    while producer.try_put(record):
        count += 1
    assert 0 < count <= 1024 // 112
    with pytest.raises(TimeoutError):
        producer.put(record, timeout=0.05)
    assert consumer.get(timeout=1) == record
    producer.put(record, timeout=1)  # room again


def test_blocked_put_is_woken_by_a_get(ring: Ends) -> None:
    producer, consumer = ring
    while producer.try_put(b"y" * 200):
        pass
    timer = threading.Timer(0.05, consumer.get)
    timer.start()
    producer.put(b"z" * 200, timeout=5)  # would raise TimeoutError if the wake-up were lost
    timer.join()


def test_blocked_get_is_woken_by_a_put(ring: Ends) -> None:
    producer, consumer = ring
    timer = threading.Timer(0.05, producer.put, args=(b"late",))
    timer.start()
    assert consumer.get(timeout=5) == b"late"
    timer.join()


def test_oversized_record_is_refused(ring: Ends) -> None:
    producer, consumer = ring
    assert producer.max_payload == 1024 // 2 - 16
    producer.put(b"a" * producer.max_payload)
    with pytest.raises(ShmError, match="exceeds"):
        producer.put(b"a" * (producer.max_payload + 1))
    assert len(consumer.get(timeout=1)) == producer.max_payload


def test_buffer_payloads_and_empty_records(ring: Ends) -> None:
    producer, consumer = ring
    producer.put(memoryview(b"abc"))
    producer.put(bytearray(b""))
    assert consumer.get(timeout=1) == b"abc"
    assert consumer.get(timeout=1) == b""


def test_second_consumer_is_refused(ring: Ends) -> None:
    producer, _ = ring
    with pytest.raises(ShmError, match="already has a consumer"):
        RingConsumer.attach(producer.name)


def test_a_new_consumer_resumes_where_the_last_stopped() -> None:
    with RingProducer.create(1024) as producer:
        for i in range(5):
            producer.put(bytes([i]))
        with RingConsumer.attach(producer.name) as first:
            assert first.get(timeout=1) == b"\x00"
            assert first.get(timeout=1) == b"\x01"
        with RingConsumer.attach(producer.name) as second:
            assert [second.get(timeout=1) for _ in range(3)] == [b"\x02", b"\x03", b"\x04"]


def test_closed_ends_refuse_use(ring: Ends) -> None:
    producer, consumer = ring
    consumer.close()
    with pytest.raises(ShmError, match="closed"):
        consumer.try_get()
    producer.close()
    with pytest.raises(ShmError, match="closed"):
        producer.try_put(b"x")


def test_corrupt_record_is_an_error_not_garbage(ring: Ends) -> None:
    producer, consumer = ring
    producer.put(b"hello")
    consumer.buf[8:16] = (99).to_bytes(8, "little")  # the record's seq no longer matches
    with pytest.raises(ShmError, match="corrupt record"):
        consumer.try_get()


def test_a_record_forged_after_the_real_ones_is_caught_by_the_producer(ring: Ends) -> None:
    # Another process publishes one well-framed record of its own after the producer's: the
    # consumer takes it, so it has read past anything the producer published. Were the
    # producer's next record the forged one's size, the consumer would skip that record
    # silently; the producer refuses the ring instead.
    producer, consumer = ring
    producer.put(b"real")
    head = producer.ctl[HEAD]
    RECORD.pack_into(producer.buf, head, 4, MESSAGE, 1)
    producer.buf[head + RECORD.size : head + RECORD.size + 4] = b"fake"
    producer.ctl[HEAD] = head + record_size(4)
    assert consumer.try_get() == b"real"
    assert consumer.try_get() == b"fake"
    with pytest.raises(ShmError, match="corrupt"):
        producer.try_put(b"next")


async def test_get_async_does_not_block_the_loop(ring: Ends) -> None:
    producer, consumer = ring
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            if ticks == 10:
                producer.put(b"ping")
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    # The record is sent from the loop: it arrives only if the loop ran while get_async waited.
    assert await consumer.get_async(timeout=5) == b"ping"
    task.cancel()


async def test_get_async_times_out(ring: Ends) -> None:
    _, consumer = ring
    with pytest.raises(TimeoutError):
        await consumer.get_async(timeout=0.05)


async def test_cancelled_get_async_loses_nothing(ring: Ends) -> None:
    producer, consumer = ring
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(consumer.get_async(), timeout=0.03)
    producer.put(b"kept")
    assert await consumer.get_async(timeout=5) == b"kept"


def test_producer_owns_and_unlinks_names() -> None:
    import os

    producer = RingProducer.create(1024)
    base = producer.name[1:]
    files = [f"/dev/shm/{base}", f"/dev/shm/sem.{base}.data", f"/dev/shm/sem.{base}.space"]
    assert all(os.stat(f).st_mode & 0o777 == 0o600 for f in files)
    consumer = RingConsumer.attach(producer.name)
    consumer.close()
    assert all(os.path.exists(f) for f in files)  # the consumer only lets go
    producer.close()
    assert not any(os.path.exists(f) for f in files)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 496), st.just(-1)), min_size=1, max_size=300))
def test_ring_behaves_like_a_bounded_queue(ops: list[int]) -> None:
    """Each op puts a record of that many bytes (when it fits) or, for -1, takes one."""
    with (
        RingProducer.create(1024) as producer,
        RingConsumer.attach(producer.name) as consumer,
    ):
        model: deque[bytes] = deque()
        for i, op in enumerate(ops):
            if op < 0:
                assert consumer.try_get() == (model.popleft() if model else None)
                continue
            payload = bytes([i % 256]) * op
            if producer.try_put(payload):
                model.append(payload)
            else:
                assert model, "an empty ring refused a record within max_payload"
        while model:
            assert consumer.try_get() == model.popleft()
        assert consumer.try_get() is None
