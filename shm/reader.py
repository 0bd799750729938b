"""The peer side of arenas: resolve handles from other processes into validated zero-copy views.

A reader attaches each arena segment the first time a handle names it and keeps it mapped.
Views are read-only and stay valid while the owner keeps the region allocated: the pipeline's
protocol says when a region is done with (the owner frees it only after the step that read it
has finished). `copy` is for a reader that cannot rely on that: it re-checks the generation after
copying, so a region freed and reused mid-copy is an error rather than mixed bytes.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from shm import pinned
from shm.handle import Handle
from shm.regions import Layout, RegionTable
from shm.segment import Segment, SegmentKind

if TYPE_CHECKING:
    import torch


class Reader:
    """Handles in, arrays out. `pin=True` page-locks each attached segment where CUDA is present."""

    def __init__(self, *, pin: bool = False) -> None:
        self._pin = pin
        self._tables: dict[str, RegionTable] = {}

    def table(self, name: str) -> RegionTable:
        """The region table of segment `name`, attaching (and validating) it on first use."""
        table = self._tables.get(name)
        if table is None:
            segment = Segment.attach(name, SegmentKind.ARENA)
            try:
                table = RegionTable(segment, Layout.read(segment))
            except BaseException:
                segment.close()
                raise
            if self._pin:
                pinned.pin(segment)
            self._tables[name] = table
        return table

    def view(self, handle: Handle) -> np.ndarray:
        """A read-only zero-copy numpy view of the handle's array."""
        return self.table(handle.segment).array(handle, writable=False)

    def copy(self, handle: Handle) -> np.ndarray:
        """A private copy of the handle's array, checked against reuse during the copy."""
        return self.table(handle.segment).copy(handle)

    def tensor(self, handle: Handle) -> torch.Tensor:
        """A zero-copy CPU torch tensor over the handle's array (torch imported on first use)."""
        import torch

        with warnings.catch_warnings():
            # torch warns that the array is read-only; the tensor is only ever read.
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.view(handle))

    def forget(self, name: str) -> None:
        """Unmap one segment (say, after its owner died). Views already handed out stay valid."""
        table = self._tables.pop(name, None)
        if table is not None:
            table.release()
            table.segment.close()

    def close(self) -> None:
        for name in list(self._tables):
            self.forget(name)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
