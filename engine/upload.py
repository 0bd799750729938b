"""Host values onto the device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | Sequence[float], device: torch.device) -> torch.Tensor:
    """`values` on `device`; a list typed as torch.tensor types it (ints int64, floats float32).

    A blocking copy to CUDA first waits for every kernel queued on the stream
    (cudaStreamSynchronize), so a step prepared while the one before it runs would stall at its
    first copy. An asynchronous copy from pageable memory returns once the driver has staged the
    values, and queues behind those kernels instead (page-locking each small array first costs
    more than the copy)."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values)
    return host.to(device, non_blocking=True)
