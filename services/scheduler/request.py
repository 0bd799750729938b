"""A request as submitted, and the state the scheduler keeps for it while it lives."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from services.protocol import PLACEHOLDER
from services.scheduler.block_manager import hash_block


@dataclass(frozen=True, eq=False)
class Request:
    seq_id: int
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
    # Sampling parameters: opaque here, passed through to the worker with its first row.
    sampling: Any = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Back in the waiting queue after preemption; resumes from the prefix cache.
    PREEMPTED = "preempted"
    FINISHED = "finished"


class RequestState:
    # Mutable and slotted: the hot loops of `schedule()` and `update()` read these fields per
    # sequence per step.
    __slots__ = (
        "arrival_time",
        "block_hashes",
        "block_ids",
        "block_size",
        "block_table",
        "capacity",
        "deadline",
        "decode_limit",
        "decoding",
        "enqueue_time",
        "hash_blocks",
        "known_to_worker",
        "last_pos",
        "last_token",
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
        "sampling",
        "seq_id",
        "session_id",
        "status",
        "stop_token_ids",
        "token_ids",
        "valid_from",
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
        self.seq_id = request.seq_id
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
        # Position of the last token it may generate (max_tokens): a decode row there would
        # sample past the end.
        self.last_pos = self.num_prompt_tokens + request.max_tokens - 1
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # An immutable copy of block_ids, rebuilt only when a block is added: plans share it.
        self.block_table: tuple[int, ...] = ()
        # Tokens the blocks can hold: the hot loop's "does it need a block" test.
        self.capacity = 0
        # min(capacity, last_pos): one test in the hot loop for "needs a block or is done".
        self.decode_limit = 0
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
        # when a row that samples is planned (the newest token may not be known yet: a plan in
        # flight samples it), cleared when the request loses its blocks.
        self.decoding = False
        # The newest token while decoding, or PLACEHOLDER while a plan in flight samples it:
        # the one token of the next decode row.
        self.last_token = PLACEHOLDER
        # Rows of plans with a smaller step id were planned for blocks this request has since
        # lost (finished, cancelled, preempted): their results are dropped. Set when it loses
        # its blocks, to the id the next plan will get.
        self.valid_from = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def effective_priority(self, now: float, aging_per_s: float) -> float:
        return self.priority + aging_per_s * (self.waited_s + max(0.0, now - self.enqueue_time))

    def set_blocks(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self.block_table = tuple(block_ids)
        self.capacity = len(block_ids) * self.block_size
        self.decode_limit = min(self.capacity, self.last_pos)

    def add_block(self, block_id: int) -> None:
        self.block_ids.append(block_id)
        self.block_table += (block_id,)
        self.capacity += self.block_size
        self.decode_limit = min(self.capacity, self.last_pos)

    def extend_hashes(self) -> None:
        if not self.hash_blocks:
            return
        hashes, size, tokens = self.block_hashes, self.block_size, self.token_ids
        for i in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size]))
