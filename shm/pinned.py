"""Page-locking mapped segments, so host-to-device copies from shared memory are DMA.

`cudaHostRegister` pins the pages of a mapping this process already has; copies from it run at
pinned-buffer speed, several times a pageable copy's (DESIGN.md has the H200's figures). The
registration must be undone before the mapping goes away, so `pin` adds a close hook to the
segment. Without torch or without a CUDA device every call is a no-op returning False. torch is
imported on first use: shm/ must stay importable (and cheap to import) where torch is absent.
"""

from __future__ import annotations

import weakref
from typing import Any

from shm.errors import ShmError
from shm.segment import Segment


def _cudart() -> Any | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.cudart()


def cuda_available() -> bool:
    return _cudart() is not None


def pin(segment: Segment) -> bool:
    """Page-lock the whole mapping; True if it is pinned now, False where there is no CUDA."""
    if segment.pinned:
        return True
    if segment.closed:
        raise ShmError(f"cannot pin {segment.name}: it is closed")
    cudart = _cudart()
    if cudart is None:
        return False
    err = int(cudart.cudaHostRegister(segment.address(), segment.size, 0))
    if err != 0:
        raise ShmError(f"cudaHostRegister of {segment.name} ({segment.size} bytes) failed: {err}")
    segment.pinned = True
    ref = weakref.ref(segment)  # a hook holding the segment itself would make a cycle

    def unpin_on_close() -> None:
        live = ref()
        if live is not None:
            unpin(live)

    segment.on_close(unpin_on_close)
    return True


def unpin(segment: Segment) -> bool:
    """Undo `pin`; True if the mapping was pinned and is not any more."""
    if not segment.pinned:
        return False
    cudart = _cudart()
    if cudart is None:
        return False
    err = int(cudart.cudaHostUnregister(segment.address()))
    segment.pinned = False
    if err != 0:
        raise ShmError(f"cudaHostUnregister of {segment.name} failed: {err}")
    return True
