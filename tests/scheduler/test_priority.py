"""Priority order, FCFS inside a level, aging, and preemption on behalf of higher priority."""

from __future__ import annotations

from services.scheduler.events import Preempted, Resumed, Scheduled
from services.scheduler.request import Request

from .utils import (
    create_requests,
    create_rig,
    create_simulation,
    expected_tokens,
    name,
    names,
    of_type,
    sid,
    tokens_of,
)


def admission_order(events: list) -> list[str]:
    return [name(e.seq_id) for e in of_type(events, Scheduled)]


def test_higher_priority_first_and_fcfs_within_a_level() -> None:
    rig = create_rig(max_num_seqs=1)
    low = create_requests(2, id_prefix="low")
    high = create_requests(2, id_prefix="high", priority=1)
    rig.add(low[0], high[0], low[1], high[1])
    assert admission_order(rig.run()) == ["high0", "high1", "low0", "low1"]


def test_fcfs_within_a_level_holds_with_aging() -> None:
    rig = create_rig(max_num_seqs=1, aging_per_s=5.0)
    for request in create_requests(4):
        rig.add(request)
        rig.clock.advance(0.01)
    assert admission_order(rig.run()) == ["r0", "r1", "r2", "r3"]


def test_negative_priorities_run_last() -> None:
    rig = create_rig(max_num_seqs=1)
    rig.add(*create_requests(1, id_prefix="bg", priority=-3), *create_requests(1, id_prefix="n"))
    assert admission_order(rig.run()) == ["n0", "bg0"]


def test_a_high_priority_request_preempts_the_lowest_running_one() -> None:
    rig = create_rig(max_num_seqs=2)
    low = create_requests(2, id_prefix="low", prompt_len=9, max_tokens=12)
    rig.add(*low)
    for _ in range(4):
        rig.step()
    (high,) = create_requests(1, id_prefix="high", priority=1, max_tokens=3)
    rig.add(high)
    plan, events = rig.step()
    (preempted,) = of_type(events, Preempted)
    # Equal ranks: the later submission is the victim.
    assert (name(preempted.seq_id), preempted.cause) == ("low1", "priority")
    assert [name(s.seq_id) for s in plan.seqs] == ["low0", "high0"]
    assert "low1" in names(plan.finished_seq_ids)
    rest = rig.run()
    (resumed,) = of_type(rest, Resumed)
    # 12 tokens computed (prompt 9 + 3 decodes) = 3 full blocks, all still in the prefix cache.
    assert preempted.num_computed_tokens == 12
    assert name(resumed.seq_id) == "low1" and resumed.num_cached_tokens == 12
    # The 4 tokens it had before are kept; the 8 after the resume follow them exactly.
    assert tokens_of(rest, "low1") == expected_tokens(low[1], 12)[4:]
    assert rig.worker.truth[sid("low1")][9:] == expected_tokens(low[1], 12)
    assert rig.scheduler.stats().num_preemptions == 1


def test_same_priority_never_preempts() -> None:
    rig = create_rig(max_num_seqs=1, aging_per_s=100.0)
    rig.add(*create_requests(1, id_prefix="a", max_tokens=20))
    rig.step()
    rig.add(*create_requests(1, id_prefix="b"))
    rig.clock.advance(5.0)  # b ages far past a, but it is not of higher priority
    events = rig.run()
    assert of_type(events, Preempted) == []


def test_a_running_request_that_aged_past_the_newcomer_is_not_preempted() -> None:
    rig = create_rig(max_num_seqs=1, aging_per_s=1.0)
    rig.add(*create_requests(1, id_prefix="old", max_tokens=20))
    rig.clock.advance(2.0)  # waited 2 s before admission: effective priority 2
    rig.step()
    rig.add(*create_requests(1, id_prefix="high", priority=1))
    _, events = rig.step()
    assert of_type(events, Preempted) == []
    # A fresh low-priority request in the same spot is preempted.
    rig2 = create_rig(max_num_seqs=1, aging_per_s=1.0)
    rig2.add(*create_requests(1, id_prefix="new", max_tokens=20))
    rig2.step()
    rig2.add(*create_requests(1, id_prefix="high", priority=1))
    _, events = rig2.step()
    assert [name(e.seq_id) for e in of_type(events, Preempted)] == ["new0"]


def test_a_high_priority_prefill_gets_a_step_without_low_priority_prefill() -> None:
    rig = create_rig(max_num_batched_tokens=64, long_prefill_token_threshold=32)
    rig.add(*create_requests(1, id_prefix="dec", prompt_len=4, max_tokens=30))
    rig.step()
    rig.add(*create_requests(1, id_prefix="long", prompt_len=120, max_tokens=2))
    plan, _ = rig.step()
    assert [(name(s.seq_id), len(s.token_ids)) for s in plan.seqs] == [("dec0", 1), ("long0", 32)]
    rig.add(*create_requests(1, id_prefix="high", prompt_len=10, priority=1))
    plan, _ = rig.step()
    # The decode still runs; the low-priority chunk waits one step.
    assert [(name(s.seq_id), len(s.token_ids)) for s in plan.seqs] == [("dec0", 1), ("high0", 10)]
    plan, _ = rig.step()
    assert ("long0", 32) in [(name(s.seq_id), len(s.token_ids)) for s in plan.seqs]
    # Without isolation the chunk shares the step.
    rig2 = create_rig(isolate_priority_prefill=False, max_num_batched_tokens=64)
    rig2.add(*create_requests(1, id_prefix="long", prompt_len=120, max_tokens=2))
    rig2.step()
    rig2.add(*create_requests(1, id_prefix="high", prompt_len=10, priority=1))
    plan, _ = rig2.step()
    assert {name(s.seq_id) for s in plan.seqs} == {"long0", "high0"}


def prefill_rows(plan) -> list[tuple[str, int]]:
    return [(name(s.seq_id), len(s.token_ids)) for s in plan.seqs if len(s.token_ids) > 1]


def test_lower_priority_prefill_yields_while_higher_priority_traffic_arrives() -> None:
    rig = create_rig(
        max_num_batched_tokens=64,
        long_prefill_token_threshold=64,
        lower_priority_prefill_tokens=12,
        priority_horizon_s=1.0,
    )
    rig.add(*create_requests(2, id_prefix="low", prompt_len=40, max_tokens=4))
    # One priority only: nobody is lower, prefill takes the whole budget.
    plan, _ = rig.step()
    assert prefill_rows(plan) == [("low0", 40), ("low1", 24)]
    (high,) = create_requests(1, id_prefix="high", prompt_len=30, max_tokens=2, priority=1)
    rig.add(high)
    plan, _ = rig.step()
    # The high prompt alone (isolation), then the low ones share 12 tokens a step between them.
    assert prefill_rows(plan) == [("high0", 30)]
    plan, _ = rig.step()
    assert prefill_rows(plan) == [("low1", 12)]
    # Once no higher-priority request has arrived for the horizon, the limit lifts.
    rig.clock.advance(1.0)
    rig.add(*create_requests(1, id_prefix="late", prompt_len=40, max_tokens=2))
    plan, _ = rig.step()
    assert prefill_rows(plan) == [("low1", 4), ("late0", 40)]
    rig.run()


def test_yielding_off_gives_lower_priority_the_budget() -> None:
    rig = create_rig(max_num_batched_tokens=64, lower_priority_prefill_tokens=0)
    rig.add(*create_requests(1, id_prefix="high", prompt_len=4, max_tokens=8, priority=1))
    rig.step()
    rig.add(*create_requests(1, id_prefix="low", prompt_len=40, max_tokens=2))
    plan, _ = rig.step()
    assert prefill_rows(plan) == [("low0", 32)]


def run_low_under_high_load(aging_per_s: float) -> tuple[float, list[tuple[float, float]]]:
    """One low-priority request among a sustained, growing backlog of high-priority ones.
    Returns the low one's arrival and admission, and (arrival, admission) of every high one."""
    sim = create_simulation(max_num_seqs=1, aging_per_s=aging_per_s, max_queued_requests=4096)
    for i, request in enumerate(create_requests(150, id_prefix="h", priority=1, max_tokens=4)):
        sim.submit(request, at=i * 0.01)
    sim.submit(Request(sid("low"), [1, 2, 3], 4), at=0.0015)
    sim.run()
    low = sim.records[sid("low")]
    assert low.reason == "length" and low.scheduled_at is not None
    highs = [
        (r.submitted_at, r.scheduled_at)
        for r in sim.records.values()
        if r.request.priority == 1 and r.scheduled_at is not None
    ]
    return low.scheduled_at - low.submitted_at, highs


def test_aging_bounds_the_wait_of_low_priority() -> None:
    # One priority level per 0.1 s: the low request behaves as if it had arrived 0.1 s later
    # than it did, so it must start before every high request that arrived after that.
    wait, highs = run_low_under_high_load(aging_per_s=10.0)
    low_arrival = 0.0015
    admitted = low_arrival + wait
    later = [admit for arrival, admit in highs if arrival > low_arrival + 0.1 + 1e-6]
    assert later and all(admitted < admit for admit in later)
    # The backlog of high requests grew far past that point: without aging it would wait longer.
    assert max(admit for _, admit in highs) > admitted + 1.0


def test_without_aging_low_priority_starves_until_the_high_load_ends() -> None:
    wait, highs = run_low_under_high_load(aging_per_s=0.0)
    assert all(admit < 0.0015 + wait for _, admit in highs)
    assert wait > 2.0


def test_no_one_is_preempted_for_a_request_that_is_passed_over_anyway() -> None:
    # The batch is full, and the waiting high-priority prompt is long while a long prefill of
    # the same priority runs: it is skipped, so nobody makes room for it.
    rig = create_rig(
        max_num_seqs=2,
        max_num_batched_tokens=12,
        long_prefill_token_threshold=8,
        max_long_prefills=1,
    )
    rig.add(*create_requests(1, id_prefix="dec", prompt_len=4, max_tokens=20))
    rig.step()
    rig.add(*create_requests(1, id_prefix="long", prompt_len=40, max_tokens=2, priority=1))
    plan, _ = rig.step()
    # Decode rows first, then prefill chunks.
    assert [(name(s.seq_id), len(s.token_ids)) for s in plan.seqs] == [("dec0", 1), ("long0", 8)]
    rig.add(*create_requests(1, id_prefix="high", prompt_len=40, max_tokens=2, priority=1))
    plan, events = rig.step()
    assert of_type(events, Preempted) == []
    assert [(name(s.seq_id), len(s.token_ids)) for s in plan.seqs] == [("dec0", 1), ("long0", 8)]
    rig.run()


def test_a_long_low_priority_prefill_does_not_hold_back_a_long_high_priority_one() -> None:
    rig = create_rig(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    rig.add(*create_requests(1, id_prefix="low", prompt_len=40, max_tokens=2))
    rig.step()
    rig.add(*create_requests(1, id_prefix="high", prompt_len=40, max_tokens=2, priority=1))
    plan, events = rig.step()
    assert [name(e.seq_id) for e in of_type(events, Scheduled)] == ["high0"]
    assert [(name(s.seq_id), len(s.token_ids)) for s in plan.seqs] == [("high0", 8)]
    assert dict(rig.scheduler.long_prefills.by_priority) == {0: 1, 1: 1}
    # Another long one at the low level still waits for the first.
    rig.add(*create_requests(1, id_prefix="low2", prompt_len=40, max_tokens=2))
    for _ in range(3):
        _, events = rig.step()
        assert "low2" not in [name(e.seq_id) for e in of_type(events, Scheduled)]
    rig.run()
