"""Property tests of async scheduling: random arrivals, cancellations, stop tokens, deadlines and
preemptions while up to two plans are in flight, with the worker running plans (in order) and
the scheduler applying results (in order) interleaved in every possible way. The books balance
after every action, the worker's KV reads back exactly each sequence's own tokens (so no block
is reused before the plans that read it ran), and every request ends once with exactly the
model's tokens up to its stop."""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from harness import invariants
from harness.sim_worker import default_model
from services.protocol import StepPlan, StepResult
from services.scheduler.request import Request

from .machine import BooksMachine
from .utils import create_rig

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

    @initialize(
        chunked=st.booleans(),
        caching=st.booleans(),
        isolate=st.booleans(),
        backlog=st.booleans(),
        yield_tokens=st.sampled_from([0, 4, 192]),
        num_kv_blocks=st.integers(10, 40),
    )
    def setup(
        self,
        chunked: bool,
        caching: bool,
        isolate: bool,
        backlog: bool,
        yield_tokens: int,
        num_kv_blocks: int,
    ) -> None:
        rig = create_rig(
            model=MODEL,
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
            session_kv_fraction=0.3,
            async_scheduling=True,
        )
        self.start(rig)
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
