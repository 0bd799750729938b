"""A request as submitted, and the state the scheduler keeps for it while it lives."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.scheduler.block_manager import hash_block


@dataclass(frozen=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    # Higher runs first (as in SGLang and Kubernetes); FCFS inside a level.
    priority: int = 0
    # Absolute time on the scheduler's clock; None means no deadline.
    deadline: float | None = None
    # Turns of one conversation share a session id, so the next turn finds its prefix cached.
    session_id: str | None = None
    # Clock time the request entered the system; None means "when add_request is called".
    arrival_time: float | None = None
    # Sampling parameters: opaque here, passed through to the worker in every plan.
    sampling: Any = field(default=None)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Back in the waiting queue after preemption; resumes from the prefix cache.
    PREEMPTED = "preempted"
    FINISHED = "finished"


class RequestState:
    # Mutable and slotted: the hot loop in `Scheduler.schedule` reads these fields per sequence.
    __slots__ = (
        "arrival_time",
        "block_hashes",
        "block_ids",
        "block_size",
        "block_table",
        "capacity",
        "deadline",
        "decoding",
        "enqueue_time",
        "hash_blocks",
        "known_to_worker",
        "long_prefill",
        "max_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_registered_blocks",
        "order",
        "priority",
        "rank",
        "request",
        "request_id",
        "sampling",
        "session_id",
        "status",
        "stop_token_ids",
        "token_ids",
        "waited_s",
    )

    def __init__(
        self,
        request: Request,
        arrival_time: float,
        order: int,
        block_size: int,
        hash_blocks: bool = True,
    ) -> None:
        self.request = request
        self.request_id = request.request_id
        self.priority = request.priority
        self.deadline = request.deadline
        self.session_id = request.session_id
        self.sampling = request.sampling
        self.max_tokens = request.max_tokens
        self.stop_token_ids = request.stop_token_ids
        self.arrival_time = arrival_time
        # Tie-break for FCFS: submission order, unique per scheduler.
        self.order = order
        self.block_size = block_size
        # The prompt followed by every generated token: what a resume must re-prefill.
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # An immutable copy of block_ids, rebuilt only when a block is added: plans share it.
        self.block_table: tuple[int, ...] = ()
        # Tokens the blocks can hold: the hot loop's "does it need a block" test.
        self.capacity = 0
        # Chained hashes of every full block of token_ids, extended as tokens arrive.
        self.block_hashes: list[bytes] = []
        self.hash_blocks = hash_blocks
        self.extend_hashes()
        # How many leading blocks have been computed and offered to the prefix cache.
        self.num_registered_blocks = 0
        self.status = Status.WAITING
        self.enqueue_time = arrival_time
        # Time spent waiting before the current stay in the queue: aging counts waiting only.
        self.waited_s = 0.0
        # Effective priority, frozen while running: orders the running list and picks victims.
        self.rank = float(self.priority)
        self.known_to_worker = False
        self.long_prefill = False
        self.num_preemptions = 0
        # Everything but the newest token is computed: the next row is a one-token decode. Set
        # when a token is sampled, cleared when the request loses its blocks.
        self.decoding = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def effective_priority(self, now: float, aging_per_s: float) -> float:
        return self.priority + aging_per_s * (self.waited_s + max(0.0, now - self.enqueue_time))

    def set_blocks(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self.block_table = tuple(block_ids)
        self.capacity = len(block_ids) * self.block_size

    def extend_hashes(self) -> None:
        if not self.hash_blocks:
            return
        hashes, size, tokens = self.block_hashes, self.block_size, self.token_ids
        for i in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size]))
