"""Async scheduling (overlap): step N+1 is planned while step N runs. Placeholders stand for the
tokens step N samples; whatever update(N) reveals (a stop, max_tokens, a cancellation, a
deadline), step N+1's rows of that request are dropped, nothing leaks, nothing is freed twice,
and no block is offered to the prefix cache before its KV was computed."""

from __future__ import annotations

import pytest

from harness import invariants
from services.protocol import PLACEHOLDER, StepPlan, StepResult
from services.scheduler.events import Finished, Preempted, Token
from services.scheduler.request import Request

from .utils import (
    Rig,
    create_requests,
    create_rig,
    create_simulation,
    expected_tokens,
    finished,
    name,
    names,
    of_type,
    sid,
    tokens_of,
)


def rows(plan: StepPlan) -> dict[str, tuple[int, list[int], bool]]:
    return {name(s.seq_id): (s.start_pos, s.token_ids, s.sample) for s in plan.seqs}


def schedule(rig: Rig) -> StepPlan:
    plan = rig.scheduler.schedule()
    invariants.check(rig.scheduler)
    return plan


def update(rig: Rig, plan: StepPlan, result: StepResult) -> list:
    events = rig.scheduler.update(plan, result)
    invariants.check(rig.scheduler)
    return events


def test_the_next_plan_carries_placeholders_for_the_tokens_in_flight() -> None:
    rig = create_rig(async_scheduling=True)
    a, b = create_requests(2, prompt_len=6, max_tokens=5)
    rig.add(a, b)
    first = schedule(rig)
    assert rows(first) == {
        "r0": (0, a.prompt_token_ids, True),
        "r1": (0, b.prompt_token_ids, True),
    }
    second = schedule(rig)
    assert second.step_id == first.step_id + 1
    # Position 6 holds the token step 0 samples: not known yet, so the row says PLACEHOLDER.
    assert rows(second) == {"r0": (6, [PLACEHOLDER], True), "r1": (6, [PLACEHOLDER], True)}
    # Room for it is reserved: 7 tokens need two blocks of 4.
    assert [len(t) for t in second.block_tables] == [2, 2]
    with pytest.raises(RuntimeError, match="await update"):
        rig.scheduler.schedule()
    # The worker runs plans in order and fills placeholders from its own samples.
    result0, result1 = rig.worker.execute(first), rig.worker.execute(second)
    with pytest.raises(ValueError, match="not the plan in flight"):
        rig.scheduler.update(second, result1)
    events = update(rig, first, result0) + update(rig, second, result1)
    for request in (a, b):
        assert tokens_of(events, name(request.seq_id)) == expected_tokens(request, 2)
    # Both tokens known now: the next decode row carries the real one.
    third = schedule(rig)
    assert rows(third)["r0"] == (7, [expected_tokens(a, 2)[1]], True)


def test_without_async_scheduling_one_plan_is_in_flight() -> None:
    rig = create_rig()
    rig.add(*create_requests(1))
    rig.scheduler.schedule()
    with pytest.raises(RuntimeError, match="await update"):
        rig.scheduler.schedule()


def test_a_stop_revealed_by_update_drops_the_next_plans_row() -> None:
    def model(request_id: str, position: int) -> int:
        return 2 if position == 7 else 5

    rig = create_rig(model=model, async_scheduling=True)
    rig.add(Request(sid("s"), [1, 1, 1, 1, 1, 1], 10, stop_token_ids=frozenset({2})))
    rig.add(*create_requests(1, prompt_len=6, max_tokens=10))
    # Step 0 prefills (samples position 6), step 1 decodes at 6 and samples the stop at 7.
    plans = [schedule(rig), schedule(rig)]
    results = [rig.worker.execute(p) for p in plans]
    events = update(rig, plans[0], results[0])
    # Step 2 decodes s at 7: the stop is in flight, nobody has seen it yet.
    plans.append(schedule(rig))
    assert "s" in names(plans[2].seq_ids)
    results.append(rig.worker.execute(plans[2]))
    used_before = rig.scheduler.stats().kv_blocks_used
    events += update(rig, plans[1], results[1])
    assert finished(events) == {"s": "stop"}
    # Its blocks are free at once, though step 2 (already sent) still has a row for it.
    assert rig.scheduler.stats().kv_blocks_used < used_before
    events += update(rig, plans[2], results[2])
    events += rig.run()
    assert tokens_of(events, "s") == [5, 2]
    assert len(of_type(events, Finished)) == 2
    assert rig.scheduler.stats().kv_blocks_used == 0


def test_no_row_after_the_last_token_max_tokens_allows() -> None:
    rig = create_rig(async_scheduling=True)
    one, three = (
        create_requests(2, prompt_len=6, max_tokens=1)[0],
        create_requests(1, id_prefix="t", prompt_len=6, max_tokens=3)[0],
    )
    rig.add(one, three)
    first = schedule(rig)
    second = schedule(rig)
    # r0's only token is sampled by step 0: nothing for it in step 1.
    assert names(second.seq_ids) == ["t0"]
    events = update(rig, first, rig.worker.execute(first))
    events += update(rig, second, rig.worker.execute(second))
    assert finished(events) == {"r0": "length"}
    events += rig.run()
    assert tokens_of(events, "t0") == expected_tokens(three, 3)


@pytest.mark.parametrize("when", ["before_execute", "between_updates"])
def test_cancel_with_two_plans_in_flight(when: str) -> None:
    rig = create_rig(async_scheduling=True)
    a, b = create_requests(2, prompt_len=6, max_tokens=8)
    rig.add(a, b)
    step = schedule(rig)
    rig.scheduler.update(step, rig.worker.execute(step))
    first, second = schedule(rig), schedule(rig)
    assert set(names(first.seq_ids)) == set(names(second.seq_ids)) == {"r0", "r1"}
    if when == "before_execute":
        assert rig.scheduler.cancel(sid("r0"))
    results = [rig.worker.execute(first), rig.worker.execute(second)]
    events = update(rig, first, results[0])
    if when == "between_updates":
        assert rig.scheduler.cancel(sid("r0"))
        events += rig.scheduler.drain_events()
    events += update(rig, second, results[1])
    # r0: one token from the first step, or none; then nothing. Its blocks were freed once.
    streamed = tokens_of(events, "r0")
    assert streamed == expected_tokens(a, 2)[1 : 1 + (when == "between_updates")]
    assert finished(events)["r0"] == "cancelled"
    nxt = schedule(rig)
    assert "r0" in names(nxt.finished_seq_ids) and "r0" not in names(nxt.seq_ids)
    events += update(rig, nxt, rig.worker.execute(nxt)) + rig.run()
    assert tokens_of(events, "r1") == expected_tokens(b, 8)[1:]
    assert rig.scheduler.stats().kv_blocks_used == 0


def test_a_running_deadline_with_a_row_in_flight() -> None:
    rig = create_rig(async_scheduling=True)
    rig.add(Request(sid("d"), list(range(100, 106)), 50, deadline=0.02))
    first = schedule(rig)
    second = schedule(rig)
    results = [rig.worker.execute(first), rig.worker.execute(second)]
    rig.clock.advance(0.03)
    events = update(rig, first, results[0])
    third = schedule(rig)  # the deadline has passed: d is stopped, its blocks freed
    assert third.is_empty
    events += update(rig, second, results[1]) + rig.scheduler.drain_events()
    assert finished(events) == {"d": "deadline"}
    assert len(tokens_of(events, "d")) == 1  # the second row's token is dropped
    assert rig.scheduler.stats().kv_blocks_used == 0


def test_a_preempted_sequence_is_dropped_from_the_plan_in_flight() -> None:
    # 5 blocks of 4: two 8-token prompts fill 4; growing past them preempts the lower one.
    rig = create_rig(num_kv_blocks=5, async_scheduling=True)
    high = Request(sid("high"), list(range(100, 108)), 12, priority=1)
    low = Request(sid("low"), list(range(200, 208)), 12)
    rig.add(high, low)
    step = schedule(rig)
    events = rig.scheduler.update(step, rig.worker.execute(step))
    inflight = [schedule(rig)]
    while True:
        inflight.append(schedule(rig))
        events += rig.scheduler.drain_events()
        if of_type(events, Preempted):
            break
        plan = inflight.pop(0)
        events += update(rig, plan, rig.worker.execute(plan))
    # Preempted while the plan before was in flight, with a row (now dead) in it.
    (pre,) = of_type(events, Preempted)
    assert name(pre.seq_id) == "low"
    assert "low" in names(inflight[0].seq_ids) and "low" not in names(inflight[1].seq_ids)
    for plan in inflight:
        events += update(rig, plan, rig.worker.execute(plan))
    events += rig.run()
    assert tokens_of(events, "low") == expected_tokens(low, 12)
    assert tokens_of(events, "high") == expected_tokens(high, 12)
    assert rig.scheduler.stats().kv_blocks_used == 0


def test_blocks_are_cached_only_once_computed() -> None:
    rig = create_rig(async_scheduling=True)
    prefix = list(range(1, 13))
    rig.add(Request(sid("a"), [*prefix, 50], 4))
    first = schedule(rig)
    # b arrives while a's prompt is in flight: a's blocks are not computed yet, so no hit.
    rig.add(Request(sid("b"), [*prefix, 60], 4))
    second = schedule(rig)
    assert rows(second)["b"][0] == 0
    assert rig.scheduler.blocks.num_cached == 0
    rig.scheduler.update(first, rig.worker.execute(first))
    assert rig.scheduler.blocks.num_cached == 3
    rig.add(Request(sid("c"), [*prefix, 70], 4))
    third = schedule(rig)
    assert rows(third)["c"][0] == 12
    rig.scheduler.update(second, rig.worker.execute(second))
    rig.scheduler.update(third, rig.worker.execute(third))
    rig.run()
    assert rig.scheduler.stats().kv_blocks_used == 0


def test_token_streams_are_the_same_with_and_without_overlap() -> None:
    streams = []
    for overlap in (False, True):
        sim = create_simulation(
            num_kv_blocks=24,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            long_prefill_token_threshold=8,
            async_scheduling=overlap,
        )
        sim.hop_s = 50e-6
        for i, request in enumerate(create_requests(12, prompt_len=10, max_tokens=20)):
            sim.submit(
                Request(sid(f"q{i}"), request.prompt_token_ids, 20, priority=i % 2), at=i * 1e-3
            )
        sim.run()
        assert all(r.reason == "length" for r in sim.records.values())
        assert sim.scheduler.num_preemptions > 0
        streams.append({k: r.tokens for k, r in sim.records.items()})
    assert streams[0] == streams[1]


def test_overlap_hides_the_hop_and_the_scheduler() -> None:
    makespans = []
    for overlap in (False, True):
        # A pool that holds them all: no preemption (a resume waits for the blocks that the
        # finishing requests give back, a round trip the worker sits out).
        sim = create_simulation(async_scheduling=overlap, num_kv_blocks=128)
        sim.hop_s = 1e-3
        sim.run()
        for request in create_requests(8, prompt_len=8, max_tokens=40):
            sim.submit(request, at=0.0)
        sim.run()
        makespans.append(sim.clock.now)
        busy = sum(step.duration for step in sim.steps)
        gaps = makespans[-1] - busy
        if overlap:
            # Only the first plan's hop out and the last result's hop back are not hidden.
            assert gaps == pytest.approx(2e-3)
    assert makespans[1] < makespans[0] - 30e-3


def test_results_must_match_their_plan() -> None:
    rig = create_rig(async_scheduling=True)
    rig.add(*create_requests(1))
    first, second = schedule(rig), schedule(rig)
    with pytest.raises(ValueError, match="result of step"):
        rig.scheduler.update(first, StepResult(second.step_id, {}))
    assert of_type(rig.scheduler.update(first, rig.worker.execute(first)), Token)
