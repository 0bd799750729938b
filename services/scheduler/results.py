"""How a step's result lands: full blocks offered to the prefix cache, sampled tokens appended
and streamed, stop conditions checked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.scheduler.events import Token
from services.scheduler.plan import ScheduledSeq
from services.scheduler.request import RequestState, Status

if TYPE_CHECKING:
    from services.scheduler.policy import Scheduler


def apply(
    s: Scheduler,
    seqs: Sequence[ScheduledSeq],
    reqs: Sequence[RequestState],
    sampled: dict[str, tuple[int, float]],
    now: float,
) -> bool:
    """Apply one step's outcome to the requests it ran; True if any of them finished (the
    caller then drops them from the running list in one pass)."""
    bs = s.config.block_size
    blocks, events = s.blocks, s.events
    any_finished = False
    for seq, req in zip(seqs, reqs, strict=True):
        if req.status is not Status.RUNNING:
            continue  # cancelled while the step ran; its blocks are already free
        full = req.num_computed_tokens // bs
        if req.num_registered_blocks < full:
            hashes, ids = req.block_hashes, req.block_ids
            for j in range(req.num_registered_blocks, min(full, len(hashes))):
                blocks.register(ids[j], hashes[j])
            req.num_registered_blocks = full
        if not seq.sample:
            continue
        out = sampled.get(req.request_id)
        if out is None:
            s.finish(req, "error", now, "the worker returned no token", unlink=False)
            any_finished = True
            continue
        token_id, logprob = out
        tokens = req.token_ids
        tokens.append(token_id)
        req.decoding = True
        if len(tokens) % bs == 0:
            req.extend_hashes()
        index = len(tokens) - req.num_prompt_tokens - 1
        events.append(Token(req.request_id, token_id, logprob, index))
        if token_id in req.stop_token_ids:
            s.finish(req, "stop", now, unlink=False)
            any_finished = True
        elif index + 1 >= req.max_tokens:
            s.finish(req, "length", now, unlink=False)
            any_finished = True
    return any_finished
