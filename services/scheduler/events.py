"""What the scheduler decided, as small immutable records.

The service turns them into per-request token streams, trace spans and metrics. `time` is the
scheduler's clock when the decision was made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

# stop: a stop token was sampled; length: max_tokens or the model context was reached;
# cancelled: the client cancelled; deadline: it could not start, or finish, in time;
# error: the worker failed it, or died (fail_all).
FinishReason = Literal["stop", "length", "cancelled", "deadline", "error"]


@dataclass(frozen=True, slots=True)
class Queued:
    seq_id: int
    time: float
    # Requests waiting (this one included) when it was queued.
    queue_depth: int


@dataclass(frozen=True, slots=True)
class Scheduled:
    """First admission into the running batch."""

    seq_id: int
    time: float
    queue_s: float
    # Prompt tokens found in the prefix cache: they are not recomputed.
    num_cached_tokens: int


class Token(NamedTuple):
    # A NamedTuple, not a frozen dataclass like the others: one is made per sequence per step,
    # and a frozen dataclass's __init__ (object.__setattr__ per field) costs three times more.
    seq_id: int
    token_id: int
    logprob: float
    # 0 for the first generated token. (The field shadows tuple.index; consumers read it.)
    index: int  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Preempted:
    seq_id: int
    time: float
    # Tokens whose KV stays only in the prefix cache (full blocks) until it resumes.
    num_computed_tokens: int
    # Why: "kv" (blocks ran out) or "priority" (a higher-priority request needed the room).
    cause: str


@dataclass(frozen=True, slots=True)
class Resumed:
    seq_id: int
    time: float
    # Of the tokens it had, how many were still cached and need no recompute.
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class Finished:
    seq_id: int
    time: float
    reason: FinishReason
    num_output_tokens: int
    message: str = ""


Event = Queued | Scheduled | Token | Preempted | Resumed | Finished
