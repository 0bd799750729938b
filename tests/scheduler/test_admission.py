"""Submission checks, backpressure, and how a step is filled: budget, max seqs, KV room."""

from __future__ import annotations

import math

import pytest

from services.scheduler.errors import InvalidRequest, QueueFull
from services.scheduler.events import Queued, Scheduled
from services.scheduler.request import Request

from .utils import (
    create_requests,
    create_rig,
    create_scheduler,
    expected_tokens,
    name,
    of_type,
    sid,
    tokens_of,
)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (Request(-1, [1], 1), "seq_id"),
        (Request(sid("a"), [], 1), "prompt_token_ids"),
        (Request(sid("a"), [1], 0), "max_tokens"),
        (Request(sid("a"), [1] * 256, 1), "prompt_token_ids"),
        (Request(sid("a"), [1] * 200, 57), "max_tokens"),
        (Request(sid("a"), [1], 1, deadline=math.nan), "deadline"),
    ],
)
def test_invalid_requests_name_the_field(request_: Request, field: str) -> None:
    sched = create_scheduler()
    with pytest.raises(InvalidRequest) as err:
        sched.add_request(request_)
    assert err.value.field == field
    assert not sched.has_unfinished()


def test_a_request_that_could_never_fit_the_kv_pool_is_refused() -> None:
    sched = create_scheduler(num_kv_blocks=8, block_size=4, max_model_len=256)
    with pytest.raises(InvalidRequest, match="KV pool of 32 tokens"):
        sched.add_request(Request(sid("a"), [1] * 30, 3))
    sched.add_request(Request(sid("b"), [1] * 30, 2))


def test_duplicate_seq_id_is_refused() -> None:
    sched = create_scheduler()
    sched.add_request(Request(sid("a"), [1, 2], 1))
    with pytest.raises(InvalidRequest) as err:
        sched.add_request(Request(sid("a"), [3], 1))
    assert err.value.field == "seq_id"


def test_backpressure_bounds_the_waiting_count() -> None:
    rig = create_rig(max_queued_requests=3)
    rig.add(*create_requests(3))
    with pytest.raises(QueueFull):
        rig.scheduler.add_request(create_requests(1, id_prefix="late")[0])
    assert rig.scheduler.stats().num_waiting == 3
    rig.step()  # admits them: the queue has room again
    rig.add(*create_requests(3, id_prefix="next"))


def test_backpressure_bounds_the_waiting_tokens() -> None:
    sched = create_scheduler(max_queued_tokens=20)
    sched.add_request(create_requests(1, prompt_len=12, id_prefix="a")[0])
    with pytest.raises(QueueFull, match="prompt tokens"):
        sched.add_request(create_requests(1, prompt_len=9, id_prefix="b")[0])
    sched.add_request(create_requests(1, prompt_len=8, id_prefix="c")[0])


def test_a_prompt_longer_than_the_queue_may_hold_is_invalid_not_backpressure() -> None:
    """A retrying client would retry RESOURCE_EXHAUSTED forever: this one never fits."""
    sched = create_scheduler(max_queued_tokens=20)
    with pytest.raises(InvalidRequest, match="21 tokens exceed max_queued_tokens=20") as err:
        sched.add_request(create_requests(1, prompt_len=21, id_prefix="a")[0])
    assert err.value.field == "prompt_token_ids"
    sched.add_request(create_requests(1, prompt_len=20, id_prefix="b")[0])  # just fits, alone
    with pytest.raises(QueueFull, match="20 prompt tokens already waiting: 1 more would pass"):
        sched.add_request(create_requests(1, prompt_len=1, id_prefix="c")[0])


def test_queued_then_scheduled_events() -> None:
    rig = create_rig()
    events = rig.add(*create_requests(2))
    assert [type(e) for e in events] == [Queued, Queued]
    assert [e.queue_depth for e in of_type(events, Queued)] == [1, 2]
    _, events = rig.step()
    scheduled = of_type(events, Scheduled)
    assert [name(e.seq_id) for e in scheduled] == ["r0", "r1"]
    assert all(e.num_cached_tokens == 0 for e in scheduled)


def test_step_respects_the_token_budget_and_max_seqs() -> None:
    rig = create_rig(max_num_batched_tokens=20, max_num_seqs=3, long_prefill_token_threshold=20)
    rig.add(*create_requests(5, prompt_len=8, max_tokens=3))
    plan, _ = rig.step()
    # 8 + 8 + 4 (a chunk of the third): the budget is filled exactly.
    assert [len(s.token_ids) for s in plan.seqs] == [8, 8, 4]
    assert [s.sample for s in plan.seqs] == [True, True, False]
    assert plan.num_prefill_tokens == 20 and plan.num_decode_tokens == 0
    plan, _ = rig.step()
    # Decodes first, then the rest of r2's prompt; max_num_seqs keeps r3 and r4 out.
    assert [(name(s.seq_id), len(s.token_ids)) for s in plan.seqs] == [
        ("r0", 1),
        ("r1", 1),
        ("r2", 4),
    ]
    assert plan.num_decode_tokens == 2 and plan.num_prefill_tokens == 4
    rig.run()


def test_block_tables_grow_block_by_block() -> None:
    rig = create_rig(block_size=4)
    rig.add(*create_requests(1, prompt_len=6, max_tokens=8))
    tables = []
    while rig.scheduler.has_unfinished():
        plan, _ = rig.step()
        tables.append((plan.seqs[0].start_pos, len(plan.seqs[0].block_table)))
    # Positions 0-5 need two blocks; position 8 is the first that needs a third, and the row
    # at 7 (its block's last slot) takes it, a step early; the last row (12) takes none.
    assert tables[0] == (0, 2)
    assert tables[1:] == [(6, 2), (7, 3), (8, 3), (9, 3), (10, 3), (11, 4), (12, 4)]
    assert rig.scheduler.stats().kv_blocks_used == 0


def test_admission_under_kv_pressure_admits_only_what_fits() -> None:
    # 10 blocks of 4 tokens; each request needs 3 blocks for its prompt (10 tokens).
    rig = create_rig(num_kv_blocks=10, block_size=4, max_num_batched_tokens=256)
    requests = create_requests(5, prompt_len=10, max_tokens=2)
    rig.add(*requests)
    plan, plan_events = rig.step()
    assert [name(s.seq_id) for s in plan.seqs] == ["r0", "r1", "r2"]
    assert rig.scheduler.stats().num_waiting == 2
    events = plan_events + rig.run()
    for request in requests:
        assert tokens_of(events, name(request.seq_id)) == expected_tokens(request, 2)
    stats = rig.scheduler.stats()
    assert stats.num_finished == {"length": 5} and stats.kv_blocks_used == 0
