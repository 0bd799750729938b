"""Page-locking: a no-op without CUDA; on a GPU, registered shared memory feeds DMA copies."""

from __future__ import annotations

import numpy as np
import pytest

from shm.arena import Arena
from shm.pinned import cuda_available, pin, unpin
from shm.reader import Reader


def test_without_cuda_pinning_is_a_no_op() -> None:
    if cuda_available():
        pytest.skip("CUDA is present")
    with Arena.create(1 << 16) as arena:
        assert pin(arena.segment) is False
        assert not arena.segment.pinned
        assert unpin(arena.segment) is False


@pytest.mark.gpu
def test_pinned_segments_copy_to_the_device_and_unregister_on_close() -> None:
    import torch

    with Arena.create(64 << 20) as arena, Reader(pin=True) as reader:
        data = np.random.default_rng(0).standard_normal(8 << 20).astype(np.float32)  # 32 MiB
        h = arena.put(data)
        assert pin(arena.segment) and arena.segment.pinned
        assert pin(arena.segment)  # idempotent
        mine = torch.from_numpy(arena.view(h))
        assert mine.is_pinned()
        theirs = reader.tensor(h)  # the reader pinned its own mapping of the segment
        assert theirs.is_pinned() and reader.table(h.segment).segment.pinned
        on_device = theirs.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), mine)
        del mine, theirs
        segment = reader.table(h.segment).segment
        reader.forget(h.segment)
        assert not segment.pinned  # unregistered before unmapping
        assert unpin(arena.segment) and not arena.segment.pinned
        assert pin(arena.segment)
    assert not arena.segment.pinned
