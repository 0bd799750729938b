"""POSIX shared memory for tensors between processes: segments, arenas, handles, rings.

The pieces the services use:

    Arena.create(capacity)          an owner's allocator: alloc/put/view/free regions by Handle
    Handle                          (segment, offset, nbytes, dtype, shape, generation); bytes
    Reader()                        a peer's validated zero-copy views: view/copy/tensor(handle)
    RingProducer.create(capacity)   the writing end of an SPSC record ring: put/try_put
    RingConsumer.attach(name)       the reading end: try_get/get/get_async
    ShmOwner()                      closes (unlinks) all of the above on exit, atexit and SIGTERM
    reap()                          unlinks what dead owners left behind (call at service start)
    pin(segment)                    page-locks a mapping where CUDA is present (no-op elsewhere)
"""

from shm.arena import Arena
from shm.consumer import RingConsumer
from shm.errors import ArenaFull, PeerGone, ShmError
from shm.handle import Handle
from shm.lifecycle import ShmOwner
from shm.pinned import pin, unpin
from shm.producer import RingProducer
from shm.reader import Reader
from shm.reaper import reap, scan
from shm.segment import Segment, SegmentKind

__all__ = [
    "Arena",
    "ArenaFull",
    "Handle",
    "PeerGone",
    "Reader",
    "RingConsumer",
    "RingProducer",
    "Segment",
    "SegmentKind",
    "ShmError",
    "ShmOwner",
    "pin",
    "reap",
    "scan",
    "unpin",
]
