"""Rings between processes: volume, order, a producer killed mid-stream, a consumer gone."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest
from _shm_peer import Peer, check_record

from shm.consumer import RingConsumer
from shm.errors import PeerGone
from shm.producer import RingProducer
from shm.reaper import reap


def _files(name: str) -> list[str]:
    base = name[1:]
    return [f"/dev/shm/{base}", f"/dev/shm/sem.{base}.data", f"/dev/shm/sem.{base}.space"]


def test_200k_records_of_random_sizes_arrive_once_in_order(spawn: Callable[..., Peer]) -> None:
    count = 200_000
    peer = spawn("produce", count, 1 << 16, 512)  # a small ring: it fills and wraps constantly
    (name,) = peer.lines(1)
    with RingConsumer.attach(name) as ring:
        for seq in range(count):
            check_record(ring.get(timeout=30), seq)
        assert ring.try_get() is None  # nothing beyond the last record: no duplicates
    assert peer.finish() == 0
    assert not any(os.path.exists(f) for f in _files(name))


def test_killed_producer_leaves_no_torn_record_and_is_reaped(spawn: Callable[..., Peer]) -> None:
    peer = spawn("produce", -1, 1 << 14, 2000)  # produces forever
    (name,) = peer.lines(1)
    with RingConsumer.attach(name, slice_s=0.02) as ring:
        seq = 0
        for _ in range(20_000):
            check_record(ring.get(timeout=30), seq)
            seq += 1
        os.kill(peer.proc.pid, signal.SIGKILL)  # most likely in the middle of a put
        peer.proc.wait()
        with pytest.raises(PeerGone, match="producer"):
            while True:  # drain: everything published before the kill is whole
                check_record(ring.get(timeout=30), seq)
                seq += 1
        assert all(os.path.exists(f) for f in _files(name))  # nobody unlinked them...
        removed = {e.path.name for e in reap()}
        assert {f.rsplit("/", 1)[1] for f in _files(name)} <= removed  # ...until the reaper
        assert not any(os.path.exists(f) for f in _files(name))
        assert ring.try_get() is None  # our mapping outlives the names


def test_producer_sees_its_consumer_die(spawn: Callable[..., Peer]) -> None:
    with RingProducer.create(1024, slice_s=0.02) as producer:
        peer = spawn("consume", producer.name)
        assert peer.lines(1) == ["attached"]
        peer.kill()
        while producer.try_put(b"q" * 100):
            pass
        with pytest.raises(PeerGone, match="consumer"):
            producer.put(b"q" * 100, timeout=30)
