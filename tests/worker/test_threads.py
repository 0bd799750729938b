"""The worker's thread policy: small decode steps leave a core to the other processes."""

from __future__ import annotations

import pytest

from services.worker.threads import SMALL_STEP_ROWS, ThreadPolicy


@pytest.mark.parametrize(
    ("threads", "cores", "prefill", "decode", "expected"),
    [
        (2, 2, 0, 1, 1),  # one stream on two cores: the tokenizer keeps a core
        (2, 2, 0, SMALL_STEP_ROWS, 1),
        (2, 2, 0, SMALL_STEP_ROWS + 1, 2),  # batched decode takes every core
        (2, 2, 128, 0, 2),  # a prefill too
        (2, 2, 1, 1, 2),  # any prefill token makes the step large
        (1, 2, 0, 1, 1),  # never more than asked for
        (1, 1, 0, 1, 1),  # never fewer than one
        (8, 16, 0, 1, 8),  # spare cores already: nothing to give up
        (16, 16, 0, 1, 15),
    ],
)
def test_threads_for_step(threads: int, cores: int, prefill: int, decode: int, expected: int):
    assert ThreadPolicy(threads, cores).for_step(prefill, decode) == expected
