"""SchedulerConfig refuses nonsense when it is built, naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from services.scheduler.config import BACKLOG_ON_CUDA, SchedulerConfig, SchedulingPolicy
from tandem.internal.v1 import hotpath_pb2 as hp

BASE: dict[str, Any] = {"num_kv_blocks": 16, "block_size": 4, "max_model_len": 64}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_kv_blocks", 0),
        ("block_size", -1),
        ("max_model_len", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("backlog_batched_tokens", -1),
        ("long_prefill_token_threshold", 0),
        ("max_long_prefills", 0),
        ("max_queued_requests", 0),
        ("max_queued_tokens", 0),
        ("window_max_seqs", 0),
        ("aging_per_s", -0.1),
        ("lower_priority_prefill_tokens", -1),
        ("priority_horizon_s", -1.0),
        ("max_wait_us", -1.0),
        ("session_kv_fraction", 1.5),
        ("block_size", 2.5),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{**BASE, field: value})


def test_without_chunking_the_budget_must_hold_the_longest_prompt() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(**BASE, enable_chunked_prefill=False, max_num_batched_tokens=32)
    SchedulerConfig(**BASE, enable_chunked_prefill=False, max_num_batched_tokens=64)


def test_a_backlog_step_budget_applies_from_as_many_waiting_tokens() -> None:
    cfg = SchedulerConfig(**BASE, max_num_batched_tokens=16, backlog_batched_tokens=64)
    assert [cfg.step_tokens(n) for n in (0, 63, 64, 1000)] == [16, 16, 64, 64]
    assert cfg.largest_step_tokens == 64
    for off in (0, 8, None):  # off, below the budget (steps never grow), not settled
        cfg = SchedulerConfig(**BASE, max_num_batched_tokens=16, backlog_batched_tokens=off)
        assert cfg.step_tokens(1000) == 16 and cfg.largest_step_tokens == 16


def test_the_backlog_budget_is_on_for_a_cuda_worker_unless_set() -> None:
    policy = SchedulingPolicy()
    assert policy.backlog_batched_tokens is None
    assert policy.on_device("cuda:0").backlog_batched_tokens == BACKLOG_ON_CUDA
    assert policy.on_device("cpu").backlog_batched_tokens == 0
    given = SchedulingPolicy(backlog_batched_tokens=0)
    assert given.on_device("cuda").backlog_batched_tokens == 0
    # What the scheduler builds when a worker attaches.
    for device, backlog in (("cuda:0", BACKLOG_ON_CUDA), ("cpu", 0)):
        model = hp.ModelDescription(num_kv_blocks=8, block_size=16, max_seq_len=64, device=device)
        cfg = SchedulerConfig.for_worker(policy, model)
        assert cfg.backlog_batched_tokens == backlog and cfg.kv_capacity_tokens == 128


def test_is_frozen_and_derives_units() -> None:
    cfg = SchedulerConfig(**BASE, max_wait_us=250.0)
    assert cfg.max_wait_s == pytest.approx(250e-6)
    assert cfg.kv_capacity_tokens == 64
    with pytest.raises(AttributeError):
        cfg.block_size = 8  # type: ignore[misc]
