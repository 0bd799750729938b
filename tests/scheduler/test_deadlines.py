"""Deadlines: a request that cannot start in time fails instead of being served late, and a
running one past its deadline is stopped with its blocks freed."""

from __future__ import annotations

from services.scheduler.events import Finished, Scheduled, Token
from services.scheduler.request import Request

from .utils import create_requests, create_rig, create_simulation, finished, name, of_type, sid


def test_a_waiting_request_past_its_deadline_fails_without_running() -> None:
    rig = create_rig(max_num_seqs=1)
    rig.add(*create_requests(1, id_prefix="busy", max_tokens=50))
    rig.step()
    rig.add(Request(sid("late"), [1, 2, 3], 4, deadline=rig.clock.now + 0.02))
    events = rig.run()
    (done,) = [e for e in of_type(events, Finished) if name(e.seq_id) == "late"]
    assert done.reason == "deadline" and done.num_output_tokens == 0
    assert "late" not in [name(e.seq_id) for e in of_type(events, Scheduled)]
    assert rig.scheduler.stats().num_finished == {"deadline": 1, "length": 1}


def test_a_running_request_past_its_deadline_is_stopped_and_its_blocks_freed() -> None:
    rig = create_rig()
    rig.add(Request(sid("slow"), list(range(1, 13)), 100, deadline=0.05))
    events: list = []
    while rig.scheduler.has_unfinished():
        _, new = rig.step()
        events += new
    (done,) = of_type(events, Finished)
    assert done.reason == "deadline"
    # It ran, and streamed what it made, until the step after its deadline passed.
    tokens = of_type(events, Token)
    assert 0 < len(tokens) < 100 and done.num_output_tokens == len(tokens)
    assert done.time >= 0.05 and rig.clock.now - 0.05 < 0.01
    stats = rig.scheduler.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_a_request_that_cannot_finish_a_step_before_its_deadline_fails_early() -> None:
    rig = create_rig()
    rig.add(*create_requests(1, id_prefix="warm", max_tokens=10))
    rig.run()  # learns that a step takes ~4.5 ms
    assert 0.004 < rig.scheduler.step_s_ewma < 0.006
    rig.add(Request(sid("tight"), [1, 2, 3], 4, deadline=rig.clock.now + 0.002))
    _, events = rig.step()
    assert finished(events) == {"tight": "deadline"}


def test_a_long_prompt_that_cannot_be_prefilled_in_time_fails_at_admission() -> None:
    rig = create_rig(max_num_batched_tokens=32, long_prefill_token_threshold=32)
    rig.add(*create_requests(1, id_prefix="warm", max_tokens=10))
    rig.run()
    now = rig.clock.now
    # 200 tokens at 32 per step is 7 steps (~30 ms); 15 ms is not enough, 60 ms is.
    rig.add(Request(sid("doomed"), list(range(1, 201)), 4, deadline=now + 0.015))
    rig.add(Request(sid("fine"), list(range(1001, 1201)), 4, deadline=now + 0.2))
    events = rig.run()
    assert finished(events) == {"doomed": "deadline", "fine": "length"}


def test_next_wakeup_names_the_deadline_so_the_loop_never_polls() -> None:
    sim = create_simulation(max_num_seqs=1)
    sim.submit(create_requests(1, id_prefix="busy", max_tokens=30)[0], at=0.0)
    sim.submit(Request(sid("queued"), [1, 2], 2, deadline=0.03), at=0.001)
    sched = sim.scheduler
    sim.run(max_steps=1)
    wakeup = sched.next_wakeup()
    assert wakeup is not None and wakeup <= 0.03
    sim.run()
    record = sim.records[sid("queued")]
    assert record.reason == "deadline"
    assert record.finished_at is not None and record.finished_at <= 0.03


def test_expiry_on_an_idle_worker_happens_at_the_wakeup() -> None:
    # A burst teaches the window that arrivals come close together; then a lone request is
    # held by the window, and its deadline falls inside it: it expires on the wake-up alone.
    sim = create_simulation(max_wait_us=50_000.0)
    for i, request in enumerate(create_requests(3, id_prefix="burst")):
        sim.submit(request, at=i * 0.001)
    sim.submit(Request(sid("held"), [1], 2, deadline=0.12), at=0.1)
    sim.run()
    record = sim.records[sid("held")]
    assert record.reason == "deadline" and record.scheduled_at is None
    assert record.finished_at is not None and 0.1 < record.finished_at <= 0.12
    assert all(step.start < 0.1 for step in sim.steps)
