"""Every test starts from the same random numbers (tests/conftest.py), whatever ran before it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

_DRAWN: list[tuple[float, float, list[float]]] = []


@pytest.mark.parametrize("run", ["first", "second, after the first drew"])
def test_each_test_draws_what_the_one_before_it_drew(run: str) -> None:
    _DRAWN.append((random.random(), float(np.random.rand()), torch.rand(2).tolist()))
    torch.rand(100)  # more than the next test would draw
    assert _DRAWN[-1] == _DRAWN[0]
