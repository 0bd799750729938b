"""A request as submitted, and the state the scheduler keeps for it while it lives."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    # False: it takes no blocks from the prefix cache, so every position of its prompt is
    # computed (the worker scores a prompt from its rows); its own are offered as any are.
    reuse_prefix: bool = True


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Back in the waiting queue after preemption; resumes from the prefix cache.
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class RequestState:
    # Slotted: the hot loops of `schedule()` and `update()` read these fields per sequence per step.
    request: Request
    arrival_time: float
    # Tie-break for FCFS: submission order, unique per scheduler.
    order: int
    block_size: int
    hash_blocks: bool = True
    # The request's fields, copied: read per step.
    seq_id: int = field(init=False)
    priority: int = field(init=False)
    deadline: float | None = field(init=False)
    session_id: str | None = field(init=False)
    sampling: Any = field(init=False)
    max_tokens: int = field(init=False)
    stop_token_ids: frozenset[int] = field(init=False)
    # The prompt followed by every generated token: what a resume must re-prefill.
    token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    # Position of the last token it may generate (max_tokens): a decode row there would
    # sample past the end.
    last_pos: int = field(init=False)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # An immutable copy of block_ids, rebuilt only when a block is added: plans share it.
    block_table: tuple[int, ...] = ()
    # Tokens the blocks can hold: the hot loop's "does it need a block" test.
    capacity: int = 0
    # min(capacity - 1, last_pos): one test in the hot loop for "needs a block, is at its
    # block's last slot (running.py takes the next block then, ahead), or is done".
    decode_limit: int = 0
    # Chained hashes of every full block of token_ids, extended as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    # How many leading blocks have been computed and offered to the prefix cache.
    num_registered_blocks: int = 0
    status: Status = Status.WAITING
    enqueue_time: float = field(init=False)
    # Time spent waiting before the current stay in the queue: aging counts waiting only.
    waited_s: float = 0.0
    # Effective priority, frozen while running: orders the running list and picks victims.
    rank: float = field(init=False)
    known_to_worker: bool = False
    long_prefill: bool = False
    num_preemptions: int = 0
    # Everything but the newest token is computed: the next row is a one-token decode. Set
    # when a row that samples is planned (the newest token may not be known yet: a plan in
    # flight samples it), cleared when the request loses its blocks.
    decoding: bool = False
    # The newest token while decoding, or PLACEHOLDER while a plan in flight samples it:
    # the one token of the next decode row.
    last_token: int = PLACEHOLDER
    # Rows of plans with a smaller step id were planned for blocks this request has since
    # lost (finished, cancelled, preempted): their results are dropped. Set when it loses
    # its blocks, to the id the next plan will get.
    valid_from: int = 0

    def __post_init__(self) -> None:
        request = self.request
        self.seq_id = request.seq_id
        self.priority = request.priority
        self.deadline = request.deadline
        self.session_id = request.session_id
        self.sampling = request.sampling
        self.max_tokens = request.max_tokens
        self.stop_token_ids = request.stop_token_ids
        self.token_ids = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.last_pos = self.num_prompt_tokens + request.max_tokens - 1
        self.enqueue_time = self.arrival_time
        self.rank = float(self.priority)
        self.extend_hashes()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def effective_priority(self, now: float, aging_per_s: float) -> float:
        return self.priority + aging_per_s * (self.waited_s + max(0.0, now - self.enqueue_time))

    def set_blocks(self, block_ids: list[int]) -> None:
        self.block_ids = block_ids
        self.block_table = tuple(block_ids)
        self.capacity = len(block_ids) * self.block_size
        self.decode_limit = min(self.capacity - 1, self.last_pos)

    def add_block(self, block_id: int) -> None:
        self.block_ids.append(block_id)
        self.block_table += (block_id,)
        self.capacity += self.block_size
        self.decode_limit = min(self.capacity - 1, self.last_pos)

    def extend_hashes(self) -> None:
        if not self.hash_blocks:
            return
        hashes, size, tokens = self.block_hashes, self.block_size, self.token_ids
        for i in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * size : (i + 1) * size]))
