"""Property tests: random arrivals, cancellations, clock jumps and steps never break the books,
and every accepted request ends exactly once with exactly the model's tokens."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from harness import invariants

from .machine import BooksMachine
from .utils import create_rig, expected_tokens


class SchedulerMachine(BooksMachine):
    @initialize(
        chunked=st.booleans(),
        caching=st.booleans(),
        isolate=st.booleans(),
        backlog=st.booleans(),
        yield_tokens=st.sampled_from([0, 4, 192]),
        max_wait_us=st.sampled_from([0.0, 2000.0]),
        num_kv_blocks=st.integers(12, 40),
    )
    def setup(
        self,
        chunked: bool,
        caching: bool,
        isolate: bool,
        backlog: bool,
        yield_tokens: int,
        max_wait_us: float,
        num_kv_blocks: int,
    ) -> None:
        rig = create_rig(
            num_kv_blocks=num_kv_blocks,
            block_size=4,
            max_model_len=48,
            max_num_seqs=4,
            max_num_batched_tokens=16 if chunked else 48,
            backlog_batched_tokens=(32 if chunked else 64) if backlog else 0,
            long_prefill_token_threshold=8,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=caching,
            isolate_priority_prefill=isolate,
            lower_priority_prefill_tokens=yield_tokens,
            priority_horizon_s=0.1,
            max_queued_requests=6,
            aging_per_s=2.0,
            max_wait_us=max_wait_us,
            session_kv_fraction=0.3,
        )
        self.start(rig)

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
