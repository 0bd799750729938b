"""The region table of an arena segment: what a reader checks before it touches a region's bytes.

Arena segment layout (little-endian; n = number of blocks, B = block size):

    offset     size   field
    0          64     segment header (segment.py), kind ARENA
    64         64     arena header: B (u64), n (u64), gens_off (u64), orders_off (u64),
                      data_off (u64), reserved
    gens_off   8n     generation per block (u64): odd = an allocated region starts at this block,
                      even = free or inside a larger region; bumped on every alloc and every free
    orders_off n      order per block (u8): a region starting here spans B << order bytes
    data_off   nB     the regions; data_off is page aligned, B is a power of two >= 64,
                      so every region is 64-byte aligned

Only the owner writes the table; it stores a region's order before bumping its generation to
odd, and x86-64 keeps stores in program order, so a reader that sees the odd generation sees the
order. A handle is good while the generation it carries equals the table's: a freed (even) or
freed-and-reused (a later odd value) region is refused, in every process, without a lock.
"""

from __future__ import annotations

import struct
from dataclasses import astuple, dataclass

import numpy as np

from shm.errors import ShmError
from shm.handle import DTYPES, Handle
from shm.segment import HEADER_SIZE, PAGE, Segment

ARENA_HEADER = struct.Struct("<QQQQQ24x")
_NP_DTYPES = {name: np.dtype(name) for name in DTYPES}
MAX_ORDER = 48


@dataclass(frozen=True)
class Layout:
    block: int  # bytes per block, a power of two >= 64
    n_blocks: int
    gens_off: int
    orders_off: int
    data_off: int

    @property
    def total(self) -> int:
        return self.data_off + self.n_blocks * self.block

    @classmethod
    def plan(cls, capacity: int, block: int) -> Layout:
        if block < 64 or block & (block - 1):
            raise ShmError(f"block size {block} must be a power of two >= 64")
        if capacity < block:
            raise ShmError(f"arena capacity {capacity} is smaller than one block ({block})")
        n = capacity // block
        gens_off = HEADER_SIZE + ARENA_HEADER.size
        orders_off = gens_off + 8 * n
        data_off = -(-(orders_off + n) // PAGE) * PAGE
        return cls(block, n, gens_off, orders_off, data_off)

    def write(self, segment: Segment) -> None:
        ARENA_HEADER.pack_into(segment.mm, HEADER_SIZE, *astuple(self))

    @classmethod
    def read(cls, segment: Segment) -> Layout:
        """The layout a peer's header claims, refused unless it fits the mapping exactly."""
        layout = cls(*map(int, ARENA_HEADER.unpack_from(segment.mm, HEADER_SIZE)))
        sane_block = 64 <= layout.block <= 1 << 40 and layout.block & (layout.block - 1) == 0
        if (
            not sane_block
            or layout.n_blocks < 1
            or layout != cls.plan(layout.n_blocks * layout.block, layout.block)
            or layout.total > segment.size
        ):
            raise ShmError(f"segment {segment.name}: corrupt arena header {layout}")
        return layout


class RegionTable:
    """The generation/order table of one arena segment, and the checks a handle must pass."""

    def __init__(self, segment: Segment, layout: Layout) -> None:
        self.segment = segment
        self.layout = layout
        self._data_end = layout.n_blocks * layout.block
        # (n_blocks,) views straight over the shared table; memoryviews index faster than numpy
        table = memoryview(segment.mm)
        self.gens = table[layout.gens_off : layout.orders_off].cast("Q")
        self.orders = table[layout.orders_off : layout.orders_off + layout.n_blocks]
        table.release()

    def locate(self, handle: Handle) -> int:
        """The block index where `handle`'s region starts, once every field checks out."""
        name, lay = self.segment.name, self.layout
        if handle.segment != name:
            raise ShmError(f"handle names segment {handle.segment}, this table is {name}")
        if self.segment.closed:
            raise ShmError(f"{handle}: segment {name} is closed in this process")
        self.segment.check()
        rel = handle.offset - lay.data_off
        if rel < 0 or rel >= self._data_end:
            raise ShmError(f"{handle}: offset {handle.offset} is outside the data area of {name}")
        if rel % lay.block:
            raise ShmError(f"{handle}: offset {handle.offset} is not at a region start")
        index = rel // lay.block
        gen = self.gens[index]
        if gen != handle.generation or not gen & 1:
            state = "a free block" if not gen & 1 else f"generation {gen}"
            raise ShmError(f"{handle}: stale generation {handle.generation}, region holds {state}")
        order = self.orders[index]
        span = lay.block << order if order <= MAX_ORDER else 0
        if span == 0 or index + (1 << order) > lay.n_blocks:
            raise ShmError(f"{handle}: corrupt region table (order {order}) in {name}")
        if handle.nbytes > span:
            raise ShmError(f"{handle}: {handle.nbytes} bytes overrun the {span}-byte region")
        return index

    def release(self) -> None:
        """Drop this table's views of the mapping so that the segment can be unmapped."""
        self.gens.release()
        self.orders.release()

    def array(self, handle: Handle, writable: bool) -> np.ndarray:
        """A zero-copy view of the region (C order), after `locate` has accepted the handle."""
        self.locate(handle)
        view = np.ndarray(handle.shape, _NP_DTYPES[handle.dtype], self.segment.mm, handle.offset)
        if not writable:
            view.flags.writeable = False
        return view

    def copy(self, handle: Handle) -> np.ndarray:
        """A private copy, re-checked after copying: a region freed mid-copy is an error."""
        out = self.array(handle, writable=False).copy()
        index = (handle.offset - self.layout.data_off) // self.layout.block
        if self.gens[index] != handle.generation:
            raise ShmError(f"{handle}: region was freed while it was being copied")
        return out
