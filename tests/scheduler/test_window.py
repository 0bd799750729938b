"""The micro-batch window: it batches arrivals on an idle worker when they come close together,
and never delays anything while sequences run or when traffic is sparse."""

from __future__ import annotations

from services.scheduler.events import Scheduled
from services.scheduler.request import Request

from .utils import create_requests, create_rig, create_simulation, name, of_type, sid


def test_window_off_admits_at_once() -> None:
    rig = create_rig(max_wait_us=0.0)
    rig.add(*create_requests(1))
    plan, _ = rig.step()
    assert len(plan.seqs) == 1


def test_window_holds_an_idle_worker_while_arrivals_are_dense() -> None:
    rig = create_rig(max_wait_us=1000.0, window_max_seqs=3)
    sched = rig.scheduler
    first, second, third = create_requests(3)
    rig.add(first)
    rig.clock.advance(0.0001)
    rig.add(second)  # a 100 µs gap: more are likely within the window
    plan, _ = rig.step()
    assert plan.is_empty
    assert sched.next_wakeup() == 0.0 + 0.001
    rig.clock.advance(0.0001)
    rig.add(third)  # window_max_seqs reached: no reason to wait longer
    plan, events = rig.step()
    assert [name(s.seq_id) for s in plan.seqs] == ["r0", "r1", "r2"]
    assert [e.queue_s for e in of_type(events, Scheduled)] == [0.0002, 0.0001, 0.0]


def test_window_closes_after_max_wait() -> None:
    rig = create_rig(max_wait_us=1000.0, window_max_seqs=8)
    a, b = create_requests(2)
    rig.add(a)
    rig.clock.advance(0.0002)
    rig.add(b)
    assert rig.step()[0].is_empty
    rig.clock.advance_to(rig.scheduler.next_wakeup() or 0.0)
    plan, _ = rig.step()
    assert [name(s.seq_id) for s in plan.seqs] == ["r0", "r1"]


def test_window_never_delays_while_sequences_run() -> None:
    rig = create_rig(max_wait_us=1000.0, window_max_seqs=8)
    a, b, c = create_requests(3, max_tokens=20)
    rig.add(a)
    rig.clock.advance(0.0001)
    rig.add(b)
    rig.clock.advance_to(0.001)
    rig.step()  # both running now
    rig.clock.advance(0.00005)
    rig.add(c)
    plan, _ = rig.step()
    assert "r2" in [name(s.seq_id) for s in plan.seqs]


def test_window_does_not_hold_sparse_traffic() -> None:
    sim = create_simulation(max_wait_us=2000.0)
    for i in range(5):
        sim.submit(Request(sid(f"s{i}"), [i + 1], 2), at=i * 0.1)
    sim.run()
    # 100 ms apart, far more than the window: each one starts the moment it arrives.
    assert all(r.queue_wait == 0.0 for r in sim.records.values())


def test_window_ttft_cost_is_bounded_by_max_wait() -> None:
    def run(max_wait_us: float) -> list[float]:
        sim = create_simulation(max_wait_us=max_wait_us)
        for k in range(10):
            for i, request in enumerate(create_requests(3, id_prefix=f"k{k}-")):
                # Bursts of three, 300 µs apart inside, 50 ms apart between bursts.
                sim.submit(request, at=k * 0.05 + i * 0.0003)
        sim.run()
        return [r.ttft or 0.0 for r in sim.records.values()]

    without, with_window = run(0.0), run(1000.0)
    # The window costs at most its own length on top of the unwindowed TTFT (plus the few µs by
    # which the joint step is longer than a lone one), and it does delay someone: the first of
    # each burst waits for the rest.
    assert max(w - o for w, o in zip(with_window, without, strict=True)) <= 0.001 + 0.0001
    assert sum(with_window) != sum(without)
