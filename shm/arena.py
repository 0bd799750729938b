"""An arena: a buddy allocator over one segment, handing out 64-byte aligned regions by handle.

The owner process allocates, writes in place and frees; peers only read, through a `Reader`.
Region sizes are `block << order` (power-of-two multiples of the block), so freeing merges a
region with its buddy in O(log n) and a region never straddles a larger free block. The free
lists live in the owner's memory; the per-block generation/order table that readers check lives
in the segment (layout in regions.py).

Any process of the same user can write into the segment, so the owner never reads its own books
back from it: live regions and their generations are kept in this process too, the shared table
is only written, and headers found written over are written again at the next allocation.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from shm.errors import ArenaFull, ShmError
from shm.handle import DTYPES, Handle
from shm.regions import ARENA_HEADER, Layout, RegionTable
from shm.segment import HEADER_SIZE, Segment, SegmentKind


class Arena:
    """Regions of one segment this process owns. Thread-safe; not shared with forked children."""

    def __init__(self, segment: Segment, layout: Layout) -> None:
        self.table = RegionTable(segment, layout)
        self.segment = segment
        self.layout = layout
        n = layout.n_blocks
        self._max_order = n.bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self._max_order + 1)]
        self._live: dict[int, int] = {}  # start block -> order
        self._gens: dict[int, int] = {}  # start block -> generation (as in the table, or was)
        self._headers = bytes(segment.mm[: HEADER_SIZE + ARENA_HEADER.size])
        self._lock = threading.Lock()
        start = 0
        while start < n:  # tile [0, n) with the largest aligned power-of-two blocks
            order = min(
                (start & -start).bit_length() - 1 if start else self._max_order,
                (n - start).bit_length() - 1,
            )
            self._free[order].add(start)
            start += 1 << order

    @classmethod
    def create(cls, capacity: int, *, block: int = 256) -> Arena:
        """An arena of at least `capacity` bytes of regions, in a new segment this process owns."""
        layout = Layout.plan(capacity, block)
        segment = Segment.create(layout.total, SegmentKind.ARENA)
        layout.write(segment)
        return cls(segment, layout)

    @property
    def name(self) -> str:
        return self.segment.name

    @property
    def free_bytes(self) -> int:
        return sum(len(s) << o for o, s in enumerate(self._free)) * self.layout.block

    def alloc(self, shape: Sequence[int] | int, dtype: DTypeLike) -> Handle:
        """Reserve a region for a C-ordered array; ArenaFull when no free region is big enough."""
        dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        name = np.dtype(dtype).name
        if name not in DTYPES or any(d < 0 for d in dims):
            raise ShmError(f"cannot place a {name} array of shape {dims} in an arena")
        nbytes = math.prod(dims) * np.dtype(dtype).itemsize
        blocks = max(1, -(-nbytes // self.layout.block))
        want = (blocks - 1).bit_length()
        with self._lock:
            order = next((o for o in range(want, self._max_order + 1) if self._free[o]), None)
            if order is None:
                raise ArenaFull(
                    f"arena {self.name}: no free region of {self.layout.block << want} bytes "
                    f"for {nbytes} ({self.free_bytes} bytes free in total)"
                )
            start = self._free[order].pop()
            while order > want:  # split, keeping the lower half
                order -= 1
                self._free[order].add(start + (1 << order))
            mm = self.segment.mm
            if mm[: len(self._headers)] != self._headers:
                mm[: len(self._headers)] = self._headers
            self.table.orders[start] = want
            gen = self._gens.get(start, 0) + 1  # even -> odd: allocated
            self._gens[start] = gen
            self.table.gens[start] = gen
            self._live[start] = want
        offset = self.layout.data_off + start * self.layout.block
        return Handle(self.name, offset, nbytes, name, dims, gen)

    def view(self, handle: Handle) -> np.ndarray:
        """A writable zero-copy view of one of this arena's live regions."""
        with self._lock:
            self._own(handle)
        return np.ndarray(handle.shape, handle.dtype, self.segment.mm, handle.offset)

    def _own(self, handle: Handle) -> int:
        """The start block of the live region `handle` names, by this process's own books."""
        if handle.segment != self.name:
            raise ShmError(f"{handle}: not a region of arena {self.name}")
        if self.segment.closed:
            raise ShmError(f"{handle}: arena {self.name} is closed")
        start, misplaced = divmod(handle.offset - self.layout.data_off, self.layout.block)
        order = None if misplaced or start < 0 else self._live.get(start)
        if order is None:
            raise ShmError(f"{handle}: not allocated by this arena")
        if self._gens[start] != handle.generation:
            raise ShmError(f"{handle}: stale generation, the region is at {self._gens[start]}")
        if handle.nbytes > self.layout.block << order:
            raise ShmError(f"{handle}: {handle.nbytes} bytes overrun the region")
        return start

    def put(self, array: ArrayLike) -> Handle:
        """Allocate a region and copy `array` into it: the one copy a writer makes."""
        src = np.asarray(array)
        handle = self.alloc(src.shape, src.dtype)
        self.view(handle)[...] = src
        return handle

    def free(self, handle: Handle) -> None:
        """Return a region; every outstanding handle to it goes stale (in every process)."""
        with self._lock:
            start = self._own(handle)
            order = self._live.pop(start)
            self._gens[start] += 1  # odd -> even: free; old handles now fail
            self.table.gens[start] = self._gens[start]
            while order < self._max_order:  # merge with free buddies
                buddy = start ^ (1 << order)
                if buddy not in self._free[order]:
                    break
                self._free[order].remove(buddy)
                start = min(start, buddy)
                order += 1
            self._free[order].add(start)

    def close(self) -> None:
        """Unlink and unmap. Peers' existing mappings stay valid; new attaches fail."""
        if not self.segment.closed:
            self.table.release()
            self.segment.close()

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Arena({self.name}, {len(self._live)} live regions, {self.free_bytes} free)"
