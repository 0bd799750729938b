"""Arena: allocation, alignment, generations, zero-copy views, and the peer's reader."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from shm.arena import Arena
from shm.errors import ArenaFull, ShmError
from shm.handle import Handle
from shm.reader import Reader


@pytest.fixture
def arena() -> Iterator[Arena]:
    with Arena.create(1 << 20, block=256) as a:
        yield a


@pytest.fixture
def reader() -> Iterator[Reader]:
    with Reader() as r:
        yield r


def test_regions_are_64_byte_aligned_in_memory(arena: Arena) -> None:
    handles = [arena.alloc((n,), "uint8") for n in (1, 63, 64, 65, 300, 5000, 0)]
    for h in handles:
        assert h.offset % 64 == 0
        assert arena.view(h).ctypes.data % 64 == 0


def test_regions_do_not_overlap(arena: Arena) -> None:
    handles = [arena.alloc((n,), "uint8") for n in (100, 256, 257, 1000, 4096, 70000, 3)]
    spans = sorted((h.offset, h.offset + max(h.nbytes, 1)) for h in handles)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start


def test_free_and_reuse_bumps_generation(arena: Arena, reader: Reader) -> None:
    first = arena.put(np.arange(8, dtype=np.int64))
    assert first.generation % 2 == 1
    arena.free(first)
    second = arena.put(np.full(8, 7, dtype=np.int64))
    assert second.offset == first.offset  # the same region, reused
    assert second.generation == first.generation + 2
    with pytest.raises(ShmError, match="stale generation"):
        reader.view(first)
    with pytest.raises(ShmError, match="stale generation"):
        arena.view(first)
    assert reader.view(second).tolist() == [7] * 8


def test_double_free_is_an_error(arena: Arena) -> None:
    h = arena.alloc((4,), "float32")
    arena.free(h)
    with pytest.raises(ShmError):
        arena.free(h)


def test_frees_merge_back_to_full_capacity(arena: Arena) -> None:
    total = arena.free_bytes
    rng = np.random.default_rng(0)
    live = [arena.alloc((int(n),), "uint8") for n in rng.integers(1, 20000, size=60)]
    for i in rng.permutation(len(live)):
        arena.free(live[i])
    assert arena.free_bytes == total
    whole = arena.alloc((total,), "uint8")  # only possible if every buddy merged again
    arena.free(whole)


def test_full_arena_raises_arena_full(arena: Arena) -> None:
    big = arena.alloc((arena.free_bytes,), "uint8")
    with pytest.raises(ArenaFull):
        arena.alloc((1,), "uint8")
    arena.free(big)
    arena.free(arena.alloc((1,), "uint8"))


def test_unsupported_dtype_is_refused_before_allocating(arena: Arena) -> None:
    before = arena.free_bytes
    with pytest.raises(ShmError, match="cannot place"):
        arena.alloc((2,), np.complex64)
    assert arena.free_bytes == before


def test_views_are_zero_copy_both_ways(arena: Arena, reader: Reader) -> None:
    h = arena.alloc((2, 3), "float32")
    mine = arena.view(h)
    mine[...] = np.arange(6, dtype=np.float32).reshape(2, 3)
    theirs = reader.view(h)
    assert theirs.shape == (2, 3) and theirs.dtype == np.float32
    assert not theirs.flags.writeable
    mine[1, 2] = 42.0  # written in place after the reader resolved the handle
    assert theirs[1, 2] == 42.0
    tensor = reader.tensor(h)
    assert tensor.shape == (2, 3) and tensor.dtype == torch.float32
    assert tensor.data_ptr() == theirs.ctypes.data
    mine[0, 0] = -1.0
    assert tensor[0, 0].item() == -1.0


def test_copy_is_private_and_checked(arena: Arena, reader: Reader) -> None:
    h = arena.put(np.arange(5, dtype=np.int32))
    out = reader.copy(h)
    arena.view(h)[...] = 0
    assert out.tolist() == [0, 1, 2, 3, 4]
    arena.free(h)
    with pytest.raises(ShmError):
        reader.copy(h)


def test_reader_rejects_out_of_bounds_and_interior_offsets(arena: Arena, reader: Reader) -> None:
    h = arena.alloc((1024,), "uint8")  # 4 blocks

    def forged(offset: int, nbytes: int) -> Handle:
        return Handle(h.segment, offset, nbytes, "uint8", (nbytes,), h.generation)

    with pytest.raises(ShmError, match="overrun"):
        reader.view(forged(h.offset, 1025))
    with pytest.raises(ShmError, match="not at a region start"):
        reader.view(forged(h.offset + 64, 8))
    with pytest.raises(ShmError, match="a free block"):
        reader.view(forged(h.offset + 256, 8))  # inside the region, at a block boundary
    with pytest.raises(ShmError, match="outside the data area"):
        reader.view(forged(0, 8))  # the header
    with pytest.raises(ShmError, match="outside the data area"):
        reader.view(forged(1 << 40, 8))


def test_reader_refuses_a_closed_arena(reader: Reader) -> None:
    arena = Arena.create(1 << 16)
    h = arena.put(np.ones(3, np.uint8))
    arena.close()
    with pytest.raises(ShmError, match="unknown segment"):
        reader.view(h)


def test_reader_refuses_a_ring_segment(reader: Reader) -> None:
    from shm.producer import RingProducer

    with RingProducer.create(4096) as ring:
        h = Handle(ring.name, 4096, 8, "uint8", (8,), 1)
        with pytest.raises(ShmError, match="expected arena"):
            reader.view(h)


def test_corrupt_arena_header_is_refused(arena: Arena, reader: Reader) -> None:
    h = arena.put(np.ones(3, np.uint8))
    arena.segment.mm[64:72] = (100).to_bytes(8, "little")  # block size no longer a power of two
    with pytest.raises(ShmError, match="corrupt arena header"):
        reader.view(h)


def test_the_owner_keeps_its_books_when_another_process_writes_over_the_segment(
    arena: Arena, reader: Reader
) -> None:
    total = arena.free_bytes
    live = arena.put(np.arange(4, dtype=np.int32))
    lay = arena.layout
    rng = np.random.default_rng(1)
    mm = arena.segment.mm
    mm[lay.gens_off : lay.orders_off + lay.n_blocks] = rng.bytes(
        lay.orders_off + lay.n_blocks - lay.gens_off
    )
    mm[0:128] = rng.bytes(128)  # the segment's header and the arena's
    with pytest.raises(ShmError):
        reader.view(live)  # a reader refuses what it cannot trust
    arena.free(live)  # the owner's own books still know the region: nothing leaks
    assert arena.free_bytes == total
    again = arena.put(np.arange(4, dtype=np.int32))  # and the headers are written again
    assert reader.view(again).tolist() == [0, 1, 2, 3]
