"""A stand-in for the worker, and a clock it advances: the scheduler tested without processes.

`SimWorker` runs a StepPlan the way the engine would, minus the model: it keeps the token
written at every KV slot and, with `check_kv`, proves on every step that each sequence reads
back exactly its own tokens (so block tables, prefix sharing and resumes are right, and no
sequence writes into another's blocks). `CostModel` says how long the step took.
`simulation.Simulation` drives the three together.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.protocol import PLACEHOLDER, StepPlan, StepResult
from services.scheduler.request import Request

# (seq_id, position of the token being sampled) -> token id. Deterministic, so a run with
# preemptions must produce exactly the tokens of a run without.
Model = Callable[[int, int], int]


class SimulationError(Exception):
    """The plan asked the worker for something impossible, or its KV was not what it claimed."""


class SimClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        if t < self.now:
            raise ValueError(f"the clock cannot go back from {self.now} to {t}")
        self.now = t

    def advance(self, dt: float) -> None:
        self.advance_to(self.now + dt)


@dataclass(frozen=True)
class CostModel:
    """One forward pass: launch overhead, then the larger of reading the weights (decode is
    memory-bound) and the matmuls over every new token (prefill is compute-bound), plus a
    per-sequence cost. The defaults are a LLaMA-3-8B-sized model in bf16 on one H200."""

    fixed_s: float = 0.5e-3
    weights_s: float = 3.5e-3
    per_token_s: float = 27e-6
    per_seq_s: float = 10e-6

    def step_time(self, plan: StepPlan) -> float:
        compute = self.per_token_s * (plan.num_prefill_tokens + plan.num_decode_tokens)
        return self.fixed_s + max(self.weights_s, compute) + self.per_seq_s * plan.num_seqs


def default_model(vocab_size: int = 32000) -> Model:
    def model(seq_id: int, position: int) -> int:
        return (zlib.crc32(str(seq_id).encode()) * 7919 + position * 104729) % vocab_size

    return model


class SimWorker:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model: Model | None = None,
        check_kv: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model = model or default_model()
        self.check_kv = check_kv
        # The KV "memory": the token id whose key/value sits in each slot, None if never written.
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        # What each request's sequence truly is (prompt + every token sampled for it): the oracle
        # the KV contents are checked against.
        self.truth: dict[int, list[int]] = {}
        self.forgotten: set[int] = set()
        self.steps = 0
        # The last plan run and what it sampled: where placeholders in the next plan come from.
        self.last_step = -1
        self.last_sampled: dict[int, tuple[int, float]] = {}

    def register(self, request: Request) -> None:
        self.truth[request.seq_id] = list(request.prompt_token_ids)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run a plan: plans must come in step order, and a PLACEHOLDER token becomes what
        this worker sampled for the same request in the plan just before (step_id - 1)."""
        if plan.step_id <= self.last_step:
            raise SimulationError(f"step {plan.step_id} after step {self.last_step}")
        previous = self.last_sampled if plan.step_id == self.last_step + 1 else {}
        self.steps += 1
        self.forgotten.update(plan.finished_seq_ids)
        sampled: dict[int, tuple[int, float]] = {}
        seen: set[int] = set()
        rows = zip(
            plan.seq_ids,
            plan.row_tokens(),
            plan.start_pos,
            plan.block_tables,
            plan.sample,
            strict=True,
        )
        for seq_id, token_ids, start, table, sample in rows:
            if seq_id in seen:
                raise SimulationError(f"step {plan.step_id}: {seq_id} planned twice")
            seen.add(seq_id)
            if PLACEHOLDER in token_ids:
                if len(token_ids) != 1 or seq_id not in previous:
                    raise SimulationError(
                        f"step {plan.step_id}: {seq_id} has a placeholder, but step "
                        f"{plan.step_id - 1} sampled nothing for it"
                    )
                token_ids = [previous[seq_id][0]]
            end = start + len(token_ids)
            if not token_ids or len(table) * self.block_size < end:
                raise SimulationError(
                    f"step {plan.step_id}: {seq_id} has {len(table)} blocks for {end} tokens"
                )
            if self.check_kv:
                self._check_and_write(seq_id, token_ids, start, table)
            if sample:
                token_id = self.model(seq_id, end)
                sampled[seq_id] = (token_id, -0.5)
                truth = self.truth.get(seq_id)
                if truth is not None and len(truth) == end:
                    truth.append(token_id)
        self.last_step = plan.step_id
        self.last_sampled = sampled
        return StepResult(plan.step_id, dict(sampled))

    def _check_and_write(
        self, seq_id: int, token_ids: Sequence[int], start: int, table: Sequence[int]
    ) -> None:
        truth = self.truth.get(seq_id)
        if truth is None:
            raise SimulationError(f"{seq_id} was never registered with the worker")
        bs, kv = self.block_size, self.kv
        end = start + len(token_ids)
        if list(token_ids) != truth[start:end]:
            raise SimulationError(f"{seq_id}: new tokens at {start} differ from its sequence")
        if any(not 0 <= b < self.num_blocks for b in table):
            raise SimulationError(f"{seq_id}: block id out of range in {table}")
        for pos in range(start):
            if kv[table[pos // bs]][pos % bs] != truth[pos]:
                raise SimulationError(
                    f"{seq_id}: KV at position {pos} (block {table[pos // bs]}) is "
                    f"{kv[table[pos // bs]][pos % bs]}, not {truth[pos]}"
                )
        for pos in range(start, end):
            kv[table[pos // bs]][pos % bs] = truth[pos]
