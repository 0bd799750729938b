"""A fake tandem `Generation` servicer: scripted token messages at scripted delays."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from grpc import aio

from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc


@dataclass(frozen=True)
class Plan:
    """One Generate call: after each delay, a message with that many tokens; then the end."""

    steps: tuple[tuple[float, int], ...]  # (seconds to wait, tokens in the message)
    prompt_tokens: int = 5
    cached_tokens: int = 2
    abort: tuple[grpc.StatusCode, str] | None = None  # instead of finishing
    usage: bool = True


def index_of(request: pb.GenerateRequest) -> int:
    return int(request.request_id.removeprefix("bench-"))


@dataclass
class FakeTandem(generation_pb2_grpc.GenerationServicer):
    plan: Callable[[pb.GenerateRequest], Plan]
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def Generate(
        self, request: pb.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            plan = self.plan(request)
            rid = request.request_id
            yield pb.GenerateResponse(request_id=rid, prompt_token_ids=[1] * plan.prompt_tokens)
            sent = 0
            for i, (delay, k) in enumerate(plan.steps):
                await asyncio.sleep(delay)
                msg = pb.GenerateResponse(
                    request_id=rid, text="w" * k, token_ids=list(range(sent, sent + k))
                )
                sent += k
                if i == len(plan.steps) - 1 and plan.abort is None:
                    msg.finish_reason = "length"
                    if plan.usage:
                        msg.usage.prompt_tokens = plan.prompt_tokens
                        msg.usage.completion_tokens = sent
                        msg.usage.cached_prompt_tokens = plan.cached_tokens
                yield msg
            if plan.abort is not None:
                await context.abort(*plan.abort)
        finally:
            self.in_flight -= 1
