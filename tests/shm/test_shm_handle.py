"""Handles: the wire format, and a reader that turns every bad handle into a ShmError."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shm.arena import Arena
from shm.errors import ShmError
from shm.handle import DTYPES, Handle
from shm.reader import Reader


def test_round_trip_is_small() -> None:
    h = Handle("/tandem-12-0123456789abcdef", 4096, 24, "float32", (2, 3), 7)
    data = h.to_bytes()
    assert Handle.from_bytes(data) == h
    assert len(data) < 80


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        (dict(dtype="object"), "dtype 'object'"),
        (dict(nbytes=25), "but float32"),
        (dict(shape=(2, -3), nbytes=-24), "out of range"),
        (dict(offset=-1), "offset -1"),
        (dict(shape=(1,) * 9, nbytes=4), "dimensions"),
        (dict(segment="/dev/shm/x"), "bad segment name"),
        (dict(shape=(2.0, 3)), "integers"),
    ],
)
def test_constructor_validates(kwargs: dict[str, object], problem: str) -> None:
    fields: dict[str, object] = dict(
        segment="/tandem-12-0123456789abcdef",
        offset=0,
        nbytes=24,
        dtype="float32",
        shape=(2, 3),
        generation=1,
    )
    fields.update(kwargs)
    with pytest.raises(ShmError, match=problem):
        Handle(**fields)  # type: ignore[arg-type]


@settings(deadline=None)
@given(st.binary(max_size=120))
def test_from_bytes_never_raises_anything_else(data: bytes) -> None:
    with contextlib.suppress(ShmError):
        Handle.from_bytes(data)


World = tuple[Arena, Reader, dict[tuple[int, int], bytes]]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """An arena with live and freed regions whose contents are known, and a peer's reader."""
    with Arena.create(1 << 16, block=64) as arena, Reader() as reader:
        rng = np.random.default_rng(7)
        live: dict[tuple[int, int], bytes] = {}  # (offset, generation) -> bytes written
        for i, n in enumerate((1, 7, 64, 65, 200, 1000, 3000, 5)):
            data = rng.integers(0, 255, size=n, dtype=np.uint8)
            h = arena.put(data)
            if i % 3 == 2:
                arena.free(h)  # stale handles in the mix
            else:
                live[(h.offset, h.generation)] = data.tobytes()
        yield arena, reader, live


def _check_outcome(world: World, handle: Handle) -> None:
    """Either bytes of the one live region the handle names, or a ShmError. Nothing else."""
    arena, reader, live = world
    try:
        got = reader.view(handle).tobytes()
    except ShmError:
        return
    written = live.get((handle.offset, handle.generation))
    assert written is not None, f"{handle} resolved but names no live region"
    start = (handle.offset - arena.layout.data_off) // arena.layout.block
    assert handle.nbytes <= arena.layout.block << int(arena.table.orders[start])
    assert got[: len(written)] == written[: handle.nbytes]


dims = st.lists(st.integers(0, 1 << 20), max_size=4).map(tuple)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_handles_are_data_or_shm_error(world: World, data: st.DataObject) -> None:
    arena = world[0]
    segment = data.draw(st.sampled_from([arena.name, "/tandem-1-0123456789abcdef"]))
    offset, generation = data.draw(st.sampled_from(sorted(world[2])))
    base = Handle(arena.name, offset, 0, "uint8", (0,), generation)
    offset = data.draw(
        st.one_of(st.just(base.offset), st.integers(0, 1 << 17), st.integers(0, (1 << 62) - 1))
    )
    dtype = data.draw(st.sampled_from(DTYPES))
    shape = data.draw(dims)
    itemsize = np.dtype(dtype).itemsize
    nbytes = int(np.prod(shape, dtype=object)) * itemsize if shape else itemsize
    generation = data.draw(st.one_of(st.just(base.generation), st.integers(0, 1 << 40)))
    try:
        handle = Handle(segment, offset, nbytes, dtype, shape, generation)
    except ShmError:
        return
    _check_outcome(world, handle)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_corrupted_handle_bytes_are_data_or_shm_error(world: World, data: st.DataObject) -> None:
    arena = world[0]
    offset, generation = data.draw(st.sampled_from(sorted(world[2])))
    nbytes = data.draw(st.integers(0, 300))
    wire = bytearray(Handle(arena.name, offset, nbytes, "uint8", (nbytes,), generation).to_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(wire) - 1))
        wire[i] ^= data.draw(st.integers(1, 255))
    if data.draw(st.booleans()):
        wire = wire[: data.draw(st.integers(0, len(wire)))]
    try:
        handle = Handle.from_bytes(bytes(wire))
    except ShmError:
        return
    _check_outcome(world, handle)
