"""What the scheduler's two hypothesis state machines share: the books, the requests they
submitted and the events they saw, the rules that need no plan in flight, and the end-of-run
accounting of every request's events."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from harness import invariants
from services.scheduler.errors import SchedulerError
from services.scheduler.events import Event, Finished, Token
from services.scheduler.request import Request

from .utils import Rig, create_rig, name, sid

# A few shared prefixes (some a block or two long) so prefix sharing happens often.
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9]]


# The policy switches both machines draw, for `policy_rig` (plus the pool's size).
POLICY = {
    "chunked": st.booleans(),
    "caching": st.booleans(),
    "isolate": st.booleans(),
    "backlog": st.booleans(),
    "yield_tokens": st.sampled_from([0, 4, 192]),
}


def policy_rig(
    chunked: bool,
    caching: bool,
    isolate: bool,
    backlog: bool,
    yield_tokens: int,
    num_kv_blocks: int,
    **extra: Any,
) -> Rig:
    """A rig with small bounds everywhere, so every limit is hit often."""
    return create_rig(
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
        **extra,
    )


class BooksMachine(RuleBasedStateMachine):
    rig: Rig
    # The stop tokens a new request carries (a machine whose model has a small vocabulary hits
    # them often).
    stops: st.SearchStrategy[frozenset[int]] = st.just(frozenset())

    def start(self, rig: Rig) -> None:
        self.rig = rig
        self.requests: dict[str, Request] = {}
        self.events: list[Event] = []
        self.n = 0

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(10, 30), min_size=1, max_size=20),
        max_tokens=st.integers(1, 16),
        priority=st.integers(-1, 2),
        deadline_in=st.one_of(st.none(), st.floats(0.001, 0.2)),
        session=st.sampled_from([None, None, "s1", "s2"]),
        data=st.data(),
    )
    def add(
        self,
        prefix: list[int],
        suffix: list[int],
        max_tokens: int,
        priority: int,
        deadline_in: float | None,
        session: str | None,
        data: st.DataObject,
    ) -> None:
        """A new request; one the scheduler refuses (a full queue) is not kept."""
        deadline = None if deadline_in is None else self.rig.clock.now + deadline_in
        prompt, stops = [*prefix, *suffix], data.draw(self.stops)
        request = Request(sid(f"q{self.n}"), prompt, max_tokens, stops, priority, deadline, session)
        self.n += 1
        try:
            self.events += self.rig.add(request)
        except SchedulerError:
            return
        self.requests[name(request.seq_id)] = request

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        self.rig.scheduler.cancel(sid(data.draw(st.sampled_from(sorted(self.requests)))))
        self.events += self.rig.scheduler.drain_events()

    @rule(dt=st.floats(0.0, 0.05))
    def wait(self, dt: float) -> None:
        self.rig.clock.advance(dt)

    @invariant()
    def books_balance(self) -> None:
        if hasattr(self, "rig"):
            invariants.check(self.rig.scheduler)

    def finished_books(self) -> tuple[dict[str, Finished], dict[str, list[Token]]]:
        """After the drain: only session pins hold blocks, and every accepted request ended
        exactly once. Returns each request's end and its tokens, checked to be numbered 0..n-1
        and counted by the end."""
        sched = self.rig.scheduler
        assert not sched.has_unfinished()
        self.events += sched.drain_events()
        # Two sessions may pin the same prefix block.
        pinned = {block for _, ids in sched.sessions.items() for block in ids}
        assert sched.stats().kv_blocks_used == len(pinned)
        ends: dict[str, list[Finished]] = defaultdict(list)
        tokens: dict[str, list[Token]] = defaultdict(list)
        for e in self.events:
            if isinstance(e, Finished):
                ends[name(e.seq_id)].append(e)
            elif isinstance(e, Token):
                tokens[name(e.seq_id)].append(e)
        assert set(ends) == set(self.requests)
        for request_id in self.requests:
            (end,) = ends[request_id]
            got = tokens[request_id]
            assert [t.index for t in got] == list(range(len(got)))
            assert end.num_output_tokens == len(got)
        return {r: ends[r][0] for r in self.requests}, tokens
