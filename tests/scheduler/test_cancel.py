"""Cancellation, worker failure, and misuse of the step contract."""

from __future__ import annotations

import pytest

from services.protocol import StepResult
from services.scheduler.events import Finished, Scheduled, Token
from services.scheduler.request import Request

from .utils import (
    create_requests,
    create_rig,
    expected_tokens,
    finished,
    name,
    names,
    of_type,
    sid,
    tokens_of,
)


def test_cancelling_a_waiting_request() -> None:
    rig = create_rig(max_num_seqs=1)
    rig.add(*create_requests(2, max_tokens=5))
    rig.step()
    assert rig.scheduler.cancel(sid("r1"))
    events = rig.scheduler.drain_events()
    assert finished(events) == {"r1": "cancelled"}
    assert rig.scheduler.stats().num_waiting == 0
    events = rig.run()
    assert "r1" not in [name(e.seq_id) for e in of_type(events, Scheduled)]
    assert not rig.scheduler.cancel(sid("r1"))


def test_cancelling_a_running_request_frees_its_blocks_at_once() -> None:
    rig = create_rig()
    rig.add(*create_requests(2, prompt_len=10, max_tokens=20))
    rig.step()
    used = rig.scheduler.stats().kv_blocks_used
    assert rig.scheduler.cancel(sid("r0"))
    assert rig.scheduler.stats().kv_blocks_used == used - 3
    plan, _ = rig.step()
    assert names(plan.finished_seq_ids) == ["r0"]
    assert [name(s.seq_id) for s in plan.seqs] == ["r1"]


def test_cancelling_during_a_step_drops_its_token() -> None:
    rig = create_rig()
    rig.add(*create_requests(2, max_tokens=5))
    plan = rig.scheduler.schedule()
    result = rig.worker.execute(plan)
    rig.scheduler.cancel(sid("r0"))
    assert rig.scheduler.stats().kv_blocks_used == 2  # r1's only
    events = rig.scheduler.update(plan, result)
    assert [name(e.seq_id) for e in of_type(events, Token)] == ["r1"]
    assert finished(events) == {"r0": "cancelled"}
    events += rig.run()
    assert rig.scheduler.stats().num_finished == {"cancelled": 1, "length": 1}


def test_fail_all_ends_everything_and_starts_the_books_over() -> None:
    rig = create_rig(max_num_seqs=2)
    rig.add(*create_requests(4, prompt_len=8, max_tokens=10))
    rig.step()
    events = rig.scheduler.fail_all("worker exited with signal 9")
    done = of_type(events, Finished)
    assert {name(e.seq_id) for e in done} == {"r0", "r1", "r2", "r3"}
    assert all(e.reason == "error" and "signal 9" in e.message for e in done)
    stats = rig.scheduler.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert (stats.kv_blocks_used, stats.kv_blocks_cached) == (0, 0)
    # Nothing is in flight any more, and the scheduler serves new requests.
    (again,) = create_requests(1, id_prefix="again", max_tokens=3)
    rig.add(again)
    assert tokens_of(rig.run(), "again0") == expected_tokens(again, 3)


def test_a_missing_token_fails_that_request_only() -> None:
    rig = create_rig()
    requests = create_requests(2, max_tokens=3)
    rig.add(*requests)
    plan = rig.scheduler.schedule()
    result = rig.worker.execute(plan)
    del result.sampled[sid("r0")]
    events = rig.scheduler.update(plan, result)
    (failed,) = of_type(events, Finished)
    assert (name(failed.seq_id), failed.reason) == ("r0", "error")
    assert tokens_of(events + rig.run(), "r1") == expected_tokens(requests[1], 3)
    assert rig.scheduler.stats().kv_blocks_used == 0


def test_a_request_the_worker_could_not_run_fails_alone_with_the_reason() -> None:
    # Chunked: the failed request's prefill spans several steps, and it ends at the first.
    rig = create_rig(max_num_batched_tokens=16)
    requests = create_requests(2, prompt_len=24, max_tokens=3)
    rig.add(*requests)
    plan = rig.scheduler.schedule()
    result = rig.worker.execute(plan)
    result.failed[sid("r0")] = "prompt: ids outside [0, 100)"
    events = rig.scheduler.update(plan, result)
    (failed,) = of_type(events, Finished)
    assert (name(failed.seq_id), failed.reason) == ("r0", "error")
    assert (
        failed.message
        == "INTERNAL: the worker could not run the request: prompt: ids outside [0, 100)"
    )
    assert tokens_of(events + rig.run(), "r1") == expected_tokens(requests[1], 3)
    assert rig.scheduler.stats().kv_blocks_used == 0


def test_stop_token_ends_with_stop() -> None:
    def model(request_id: str, position: int) -> int:
        return 2 if position == 7 else 5

    rig = create_rig(model=model)
    rig.add(Request(sid("s"), [1, 1, 1, 1, 1], 10, stop_token_ids=frozenset({2})))
    events = rig.run()
    # Positions 5, 6 sample 5; position 7 samples the stop token, which is streamed too.
    assert tokens_of(events, "s") == [5, 5, 2]
    (done,) = of_type(events, Finished)
    assert (done.reason, done.num_output_tokens) == ("stop", 3)


def test_the_step_contract_is_enforced() -> None:
    rig = create_rig()
    rig.add(*create_requests(1))
    plan = rig.scheduler.schedule()
    with pytest.raises(RuntimeError, match="await update"):
        rig.scheduler.schedule()
    with pytest.raises(ValueError, match="result of step"):
        rig.scheduler.update(plan, StepResult(plan.step_id + 1, {}))
    result = rig.worker.execute(plan)
    rig.scheduler.update(plan, result)
    with pytest.raises(ValueError, match="not the plan in flight"):
        rig.scheduler.update(plan, result)
