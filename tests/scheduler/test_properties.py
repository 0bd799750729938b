"""Property tests: random arrivals, cancellations, clock jumps and steps never break the books,
and every accepted request ends exactly once with exactly the model's tokens."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from harness import invariants

from .machine import POLICY, BooksMachine, policy_rig
from .utils import expected_tokens


class SchedulerMachine(BooksMachine):
    @initialize(
        **POLICY,
        max_wait_us=st.sampled_from([0.0, 2000.0]),
        num_kv_blocks=st.integers(12, 40),
    )
    def setup(self, **draws: Any) -> None:
        self.start(policy_rig(**draws))

    @rule(k=st.integers(1, 4))
    def step(self, k: int) -> None:
        for _ in range(k):
            plan, events = self.rig.step()
            self.events += events
            if plan.is_empty:
                break

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cancel_during_a_step(self, data: st.DataObject) -> None:
        sched = self.rig.scheduler
        plan = sched.schedule()
        if plan.is_empty:
            self.events += sched.drain_events()
            return
        result = self.rig.worker.execute(plan)
        sched.cancel(data.draw(st.sampled_from(sorted(self.requests))))
        invariants.check(sched)
        self.events += sched.update(plan, result)

    def teardown(self) -> None:
        if not hasattr(self, "rig"):
            return
        rig, sched = self.rig, self.rig.scheduler
        for _ in range(2000):
            if not sched.has_unfinished():
                break
            plan, events = rig.step()
            self.events += events
            if plan.is_empty and sched.has_unfinished():
                wakeup = sched.next_wakeup()
                assert wakeup is not None, "stalled: work left, nothing to wait for"
                rig.clock.advance_to(max(wakeup, rig.clock.now))
        ends, tokens = self.finished_books()
        for request_id, request in self.requests.items():
            end, got = ends[request_id], tokens[request_id]
            assert [t.token_id for t in got] == expected_tokens(request, len(got))
            if end.reason == "length":
                assert len(got) == request.max_tokens


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
