"""One request's token events → its GenerateResponse messages: text deltas, logprobs, the end."""

from __future__ import annotations

import grpc

from engine.stop_strings import StopStringMatcher
from engine.tokenizer import Detokenizer, Tokenizer
from services.errors import ServiceError
from services.tokenizer.prompt_logprobs import PromptLogprobs
from services.tokenizer.request import GenerateSpec
from tandem.internal.v1 import hotpath_pb2 as hp
from tandem.v1 import generation_pb2 as pb

_STATUS_OF_REASON = {
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "cancelled": grpc.StatusCode.CANCELLED,
}


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        spec: GenerateSpec,
        stop_ids: frozenset[int],
        scored_prompt: list[int] | None = None,
    ) -> None:
        """scored_prompt: the prompt's ids, where this sequence scores it (prompt_logprobs)."""
        self.request_id = spec.request_id
        self.prompt = None if scored_prompt is None else PromptLogprobs(scored_prompt)
        self.detok = Detokenizer(tokenizer, skip_special=spec.skip_special_tokens)
        self.stops = StopStringMatcher(spec.stop_strings)
        self.include_stop = spec.include_stop_str
        self.stop_token_ids = stop_ids
        self.own_stop_ids = spec.stop_token_ids  # the request's, beside the model's own
        self.logprobs = spec.sampling.logprobs
        self.min_tokens = spec.sampling.min_tokens  # stop strings are matched after these tokens
        self.num_tokens = 0
        self.cached_prompt_tokens = 0

    def on_events(self, events: hp.RequestEvents) -> pb.GenerateResponse:
        """The message for this step's tokens; also the last one if `events` ends the request."""
        reply = pb.GenerateResponse(request_id=self.request_id)
        if events.cached_prompt_tokens:
            self.cached_prompt_tokens = events.cached_prompt_tokens
        if events.HasField("prompt_logprobs") and self.prompt is not None:
            self.prompt.add(events.prompt_logprobs)
        if events.token_ids and self.prompt is not None:  # its first tokens: the prompt is done
            reply.prompt_logprobs.extend(self.prompt.entries())
            self.prompt = None
        n = self.logprobs
        text = []
        for i, token_id in enumerate(events.token_ids):
            if self.stops.stopped:
                break
            self.num_tokens += 1
            reply.token_ids.append(token_id)
            if n:
                own = slice(i * n, (i + 1) * n)  # this token's n alternatives
                pairs = zip(events.top_ids[own], events.top_logprobs[own], strict=True)
                top = [pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in pairs]
                reply.logprobs.add(token_id=token_id, logprob=events.logprobs[i], top_logprobs=top)
            if token_id not in self.stop_token_ids:  # an end-of-sequence token has no text
                piece = self.detok.feed(token_id)
                text.append(piece if self.num_tokens <= self.min_tokens else self.stops.feed(piece))
        if self.stops.stopped:
            reply.finish_reason = "stop"
            assert self.stops.matched is not None
            reply.stop_string = self.stops.matched
            if self.include_stop:
                text.append(self.stops.matched)
        elif events.finish_reason in ("stop", "length"):
            text.append(self.stops.feed(self.detok.flush()) + self.stops.flush())
            reply.finish_reason = events.finish_reason
            last = reply.token_ids[-1] if reply.token_ids else None
            if events.finish_reason == "stop" and last in self.own_stop_ids:
                reply.stop_token_id = last
        elif events.finish_reason:
            raise ended_abnormally(events)
        reply.text = "".join(text)
        if reply.finish_reason:
            reply.usage.completion_tokens = self.num_tokens
            reply.usage.cached_prompt_tokens = self.cached_prompt_tokens
        return reply


def ended_abnormally(events: hp.RequestEvents) -> ServiceError:
    """The status a request ends with when the scheduler finished it for cause."""
    code = _STATUS_OF_REASON.get(events.finish_reason)
    message = events.error or events.finish_reason
    if code is None:
        name, _, rest = message.partition(": ")
        code = getattr(grpc.StatusCode, name, None) if name.isupper() else None
        if code is None:
            code = grpc.StatusCode.INTERNAL
        else:
            message = rest
    return ServiceError(message, code=code)
