"""The step contract between whoever schedules (the scheduler, the offline loop) and the engine."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from engine.sampling_params import GREEDY, SamplingParams

# A token not known to the caller yet: the one the engine sampled for this sequence in the step
# submitted just before (Engine.submit). The engine puts it in place on the device, so a caller
# can submit a decode step while the step that samples its input still runs.
FROM_LAST_STEP = -1


@dataclass
class SeqInput:
    seq_id: Hashable  # the caller's key for the sequence (the worker's: its integer seq id)
    token_ids: Sequence[int]  # a prefill chunk, or the last sampled token (or FROM_LAST_STEP)
    start_pos: int  # position of token_ids[0] in the sequence
    block_table: Sequence[int]  # the sequence's KV blocks in order, covering every position
    sampling: SamplingParams = GREEDY
    sample: bool = True  # False for a prefill chunk that does not reach the end of the prompt
    prompt_len: int = 0  # positions from here on are output tokens (presence/frequency penalties)
    # Tokens before start_pos, needed once when a sequence with penalties first reaches an engine
    # that has not seen its beginning (after a prefix-cache hit, or on a restarted worker).
    prefix_ids: Sequence[int] | None = None


@dataclass
class SeqOutput:
    seq_id: Hashable
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
