"""Which of cuBLAS's front ends a CUDA graph's products are captured with, by the rows it carries.

A graph keeps the kernels chosen when it was captured, so the choice costs nothing at replay.
On an H200, at LLaMA-3-8B shapes, cuBLASLt's heuristics pick faster kernels for products of
32 to 128 rows (decode steps of 64 sequences 4-5% faster) and slower ones below 24 rows and at
160 (bench/RESULTS-gpu.md). Eager steps and other graphs keep torch's default.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

LT_ROWS = range(32, 129)


def _set(backend: object) -> None:
    with warnings.catch_warnings():  # torch calls the setting experimental, once per process
        warnings.simplefilter("ignore")
        torch.backends.cuda.preferred_blas_library(backend)  # type: ignore[arg-type]


@contextlib.contextmanager
def products_for_rows(rows: int, device: torch.device) -> Iterator[None]:
    """Within the block, products on `device` use the front end chosen for `rows` rows."""
    if device.type != "cuda" or rows not in LT_ROWS:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    _set("cublaslt")
    try:
        yield
    finally:
        _set(before)
