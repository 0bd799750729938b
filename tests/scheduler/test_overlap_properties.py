"""Property tests of async scheduling: random arrivals, cancellations, stop tokens, deadlines and
preemptions while up to two plans are in flight, with the worker running plans (in order) and
the scheduler applying results (in order) interleaved in every possible way. The books balance
after every action, the worker's KV reads back exactly each sequence's own tokens (so no block
is reused before the plans that read it ran), and every request ends once with exactly the
model's tokens up to its stop."""

from __future__ import annotations

from collections import deque
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from harness import invariants
from harness.sim_worker import default_model
from services.protocol import StepPlan, StepResult
from services.scheduler.request import Request

from .machine import POLICY, BooksMachine, policy_rig

# A vocabulary of 12, so stop tokens are sampled often.
MODEL = default_model(vocab_size=12)


def expected(request: Request) -> list[int]:
    """The model's tokens for this request, up to and including its first stop token."""
    out: list[int] = []
    p = len(request.prompt_token_ids)
    while len(out) < request.max_tokens:
        out.append(MODEL(request.seq_id, p + len(out)))
        if out[-1] in request.stop_token_ids:
            break
    return out


class OverlapMachine(BooksMachine):
    stops = st.frozensets(st.integers(0, 11), max_size=2)

    @initialize(**POLICY, num_kv_blocks=st.integers(10, 40))
    def setup(self, **draws: Any) -> None:
        self.start(policy_rig(**draws, model=MODEL, async_scheduling=True))
        # Plans made and not yet run by the worker; results not yet applied.
        self.sent: deque[StepPlan] = deque()
        self.done: deque[tuple[StepPlan, StepResult]] = deque()

    @precondition(lambda self: self.rig.scheduler.num_in_flight < 2)
    @rule()
    def schedule(self) -> None:
        plan = self.rig.scheduler.schedule()
        self.events += self.rig.scheduler.drain_events()
        if not plan.is_empty:
            self.sent.append(plan)

    @precondition(lambda self: self.sent)
    @rule()
    def execute(self) -> None:
        plan = self.sent.popleft()
        self.done.append((plan, self.rig.worker.execute(plan)))

    @precondition(lambda self: self.done)
    @rule()
    def update(self) -> None:
        plan, result = self.done.popleft()
        self.events += self.rig.scheduler.update(plan, result)

    def teardown(self) -> None:
        if not hasattr(self, "rig"):
            return
        rig, sched = self.rig, self.rig.scheduler
        # Drain with two plans in flight whenever there is work for two: plan, run the older
        # plan, apply its result, plan again.
        for _ in range(3000):
            if not sched.has_unfinished() and not sched.num_in_flight:
                break
            empty = False
            while sched.num_in_flight < 2 and sched.has_unfinished() and not empty:
                plan = sched.schedule()
                self.events += sched.drain_events()
                empty = plan.is_empty
                if not empty:
                    self.sent.append(plan)
            if not sched.num_in_flight:
                if not sched.has_unfinished():
                    break  # the last ones expired in that schedule()
                wakeup = sched.next_wakeup()
                assert wakeup is not None, "stalled: work left, nothing to wait for"
                rig.clock.advance_to(max(wakeup, rig.clock.now))
                continue
            if self.sent:
                self.execute()
            self.update()
            invariants.check(sched)
        assert not sched.num_in_flight
        ends, tokens = self.finished_books()
        for request_id, request in self.requests.items():
            end, got = ends[request_id], [t.token_id for t in tokens[request_id]]
            want = expected(request)
            if end.reason in ("stop", "length"):
                assert got == want
                assert (end.reason == "stop") == (want[-1] in request.stop_token_ids)
            else:
                # Cut short (cancelled, deadline): a prefix, never a token past a stop.
                assert got == want[: len(got)]
                assert not (got and got[-1] in request.stop_token_ids)


TestOverlap = OverlapMachine.TestCase
TestOverlap.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
