"""A scored prompt's logprobs, gathered from the steps that prefilled it (each chunk's arrive
with that step's events) into the GenerateResponse entries of its tokens."""

from __future__ import annotations

from services.errors import ServiceError
from tandem.internal.v1 import hotpath_pb2 as hp
from tandem.v1 import generation_pb2 as pb


class PromptLogprobs:
    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = prompt_ids
        # Position → its entry; a re-prefilled chunk (after a preemption) writes the same again.
        self._entries: dict[int, pb.PromptTokenLogprob] = {}

    def add(self, scores: hp.PromptLogprobs) -> None:
        n = scores.top_n
        for i, (logprob, rank) in enumerate(zip(scores.logprobs, scores.ranks, strict=True)):
            position = scores.start + i
            if not 0 < position < len(self.prompt_ids):
                continue
            own = slice(i * n, (i + 1) * n)
            pairs = zip(scores.top_ids[own], scores.top_logprobs[own], strict=True)
            self._entries[position] = pb.PromptTokenLogprob(
                token_id=self.prompt_ids[position],
                logprob=logprob,
                rank=rank,
                top_logprobs=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in pairs],
            )

    def entries(self) -> list[pb.PromptTokenLogprob]:
        """Every token's from the second on; INTERNAL if a position was never scored."""
        missing = [p for p in range(1, len(self.prompt_ids)) if p not in self._entries]
        if missing:  # a ServiceError's code is INTERNAL
            raise ServiceError(
                f"the worker did not score prompt positions {missing[:5]} "
                f"({len(missing)} of {len(self.prompt_ids) - 1})"
            )
        return [self._entries[p] for p in range(1, len(self.prompt_ids))]
