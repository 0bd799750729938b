"""Host values onto the device without waiting for it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: np.ndarray | Sequence[float], device: torch.device) -> torch.Tensor:
    """`values` on `device`; a list typed as torch.tensor types it (ints int64, floats float32).

    A plain copy to CUDA from pageable memory first waits for every kernel queued on the stream
    (cudaStreamSynchronize), so a step prepared while the one before it runs would stall at its
    first copy. From page-locked memory the copy queues behind them instead; the caching host
    allocator keeps the buffer until the copy has run."""
    host = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
