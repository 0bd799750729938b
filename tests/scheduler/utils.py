"""Factories in the style of vLLM's tests/v1/core/utils.py, plus a rig that steps by hand.

Token ids of generated prompts are unique per request (no accidental prefix sharing) unless a
test passes a shared `prefix`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from harness import invariants
from harness.sim_worker import CostModel, Model, SimClock, SimWorker, default_model
from harness.simulation import Simulation
from services.protocol import StepPlan
from services.scheduler.config import SchedulerConfig
from services.scheduler.events import Event, Finished, Token
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler

DEFAULTS: dict[str, Any] = {
    "num_kv_blocks": 64,
    "block_size": 4,
    "max_model_len": 256,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 64,
    "backlog_batched_tokens": 0,  # steps of one size, unless a test asks for backlog steps
    "long_prefill_token_threshold": 32,
    "aging_per_s": 0.0,
    "async_scheduling": False,  # one plan in flight, unless a test asks for two
}

MODEL = default_model()

# Tests name requests ("low0", "high1"); the scheduler numbers them (the seq ids it is given).
# One registry maps each name to one id for the whole run, and back.
_ids: dict[str, int] = {}
_names: dict[int, str] = {}


def sid(name: str) -> int:
    """The seq id of the request a test calls `name`."""
    if name not in _ids:
        _ids[name] = len(_ids)
        _names[_ids[name]] = name
    return _ids[name]


def name(seq_id: int) -> str:
    return _names.get(seq_id, str(seq_id))


def names(seq_ids: Iterable[int]) -> list[str]:
    return [name(i) for i in seq_ids]


def create_scheduler(clock: SimClock | None = None, **overrides: Any) -> Scheduler:
    config = SchedulerConfig(**{**DEFAULTS, **overrides})
    return Scheduler(config, clock or SimClock())


# 10_000 and up: never equal to a small shared-prefix token a test writes by hand.
_token_ids = itertools.count(10_000)


def create_requests(
    n: int,
    prompt_len: int = 8,
    max_tokens: int = 4,
    prefix: Sequence[int] = (),
    id_prefix: str = "r",
    **fields: Any,
) -> list[Request]:
    out = []
    for i in range(n):
        own = [next(_token_ids) for _ in range(prompt_len)]
        out.append(Request(sid(f"{id_prefix}{i}"), [*prefix, *own], max_tokens, **fields))
    return out


def expected_tokens(request: Request, n: int, model: Model = MODEL) -> list[int]:
    """The n tokens the simulated model generates for this request: what must come out."""
    p = len(request.prompt_token_ids)
    return [model(request.seq_id, p + i) for i in range(n)]


@dataclass
class Rig:
    """A scheduler, its clock and a KV-checking simulated worker, stepped by hand."""

    scheduler: Scheduler
    clock: SimClock
    worker: SimWorker
    cost: CostModel

    @property
    def config(self) -> SchedulerConfig:
        return self.scheduler.config

    def add(self, *requests: Request) -> list[Event]:
        for request in requests:
            self.worker.register(request)
            self.scheduler.add_request(request)
        return self.scheduler.drain_events()

    def step(self) -> tuple[StepPlan, list[Event]]:
        """One schedule → execute → update round; the clock moves by the step's cost."""
        plan = self.scheduler.schedule()
        invariants.check(self.scheduler)
        if plan.is_empty:
            return plan, self.scheduler.drain_events()
        result = self.worker.execute(plan)
        self.clock.advance(self.cost.step_time(plan))
        events = self.scheduler.update(plan, result)
        invariants.check(self.scheduler)
        return plan, events

    def run(self, max_steps: int = 10_000) -> list[Event]:
        events: list[Event] = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return events
            plan, new = self.step()
            events += new
            if plan.is_empty:
                raise RuntimeError("the scheduler stalled with work left")
        raise RuntimeError("did not finish")


def create_rig(model: Model = MODEL, cost: CostModel | None = None, **overrides: Any) -> Rig:
    clock = SimClock()
    scheduler = create_scheduler(clock, **overrides)
    cfg = scheduler.config
    worker = SimWorker(cfg.num_kv_blocks, cfg.block_size, model, check_kv=True)
    return Rig(scheduler, clock, worker, cost or CostModel())


def create_simulation(
    model: Model = MODEL, cost: CostModel | None = None, **overrides: Any
) -> Simulation:
    clock = SimClock()
    scheduler = create_scheduler(clock, **overrides)
    cfg = scheduler.config
    worker = SimWorker(cfg.num_kv_blocks, cfg.block_size, model, check_kv=True)
    return Simulation(scheduler, clock, worker, cost, after_step=invariants.check)


def tokens_of(events: Sequence[Event], request: str) -> list[int]:
    return [e.token_id for e in events if isinstance(e, Token) and e.seq_id == sid(request)]


def finished(events: Sequence[Event]) -> dict[str, str]:
    return {name(e.seq_id): e.reason for e in events if isinstance(e, Finished)}


def of_type(events: Sequence[Event], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]
