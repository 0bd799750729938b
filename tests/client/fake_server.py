"""A fake `Generation` servicer that plays a script and records what it was sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"


@dataclass
class Script:
    """What the fake does for one Generate call: send these, then hang or abort (or finish)."""

    responses: list[pb.GenerateResponse]
    hang: bool = False  # after the responses, wait until the client cancels
    abort: tuple[grpc.StatusCode, str] | None = None


def stream(
    pieces: Sequence[tuple[str, Sequence[int]]],
    *,
    prompt_ids: Sequence[int] = (1, 2, 3),
    request_id: str = "req-1",
    finish_reason: str = "stop",
) -> list[pb.GenerateResponse]:
    """The messages the real servicer sends: a header, then deltas, the last one finishing."""
    out = [
        pb.GenerateResponse(
            request_id=request_id, trace_id=TRACE_ID, prompt_token_ids=list(prompt_ids)
        )
    ]
    for text, ids in pieces:
        out.append(pb.GenerateResponse(request_id=request_id, text=text, token_ids=list(ids)))
    if finish_reason:
        last = out[-1]
        last.finish_reason = finish_reason
        last.usage.prompt_tokens = len(prompt_ids)
        last.usage.completion_tokens = sum(len(ids) for _, ids in pieces)
    return out


@dataclass
class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    script: Callable[[pb.GenerateRequest], Script] = lambda _: Script(stream([("hi", [7])]))
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def Generate(
        self, request: pb.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.requests.append(request)
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        # Not `except CancelledError`: a cancel that lands while grpc sends a message is raised
        # in grpc's code, not here. Any end before the script's own end is the client's doing.
        played = False

        def on_done(_: aio.ServicerContext) -> None:
            if not played:
                self.cancelled.set()

        context.add_done_callback(on_done)
        script = self.script(request)
        self.started.set()
        for response in script.responses:
            yield response
        if script.hang:
            await asyncio.Event().wait()  # only the client's cancel (or deadline) ends this
        played = True
        if script.abort is not None:
            await context.abort(*script.abort)

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: aio.ServicerContext
    ) -> pb.TokenizeResponse:
        if request.WhichOneof("input") == "chat":
            return pb.TokenizeResponse(token_ids=[len(m.content) for m in request.chat.messages])
        return pb.TokenizeResponse(token_ids=[ord(c) for c in request.text])

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        if request.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model: unknown model 'x'")
        return pb.DetokenizeResponse(text="".join(chr(i) for i in request.token_ids))

    async def ListModels(
        self, request: pb.ListModelsRequest, context: aio.ServicerContext
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(name="fake", context_length=2048, vocab_size=49152)]
        )


@dataclass
class FakeServer:
    address: str
    servicer: FakeGeneration
    health: health_aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        await self.health.set("", status.SERVING if serving else status.NOT_SERVING)


class WatchedHealth(health_aio.HealthServicer):
    """Health checking that says when a watcher has had its first reply."""

    def __init__(self) -> None:
        super().__init__()
        self.watched = asyncio.Event()

    async def Watch(self, request, context):  # type: ignore[no-untyped-def]
        asyncio.get_running_loop().call_later(0.2, self.watched.set)
        await super().Watch(request, context)


async def health_server(address: str, serving: bool) -> tuple[aio.Server, WatchedHealth]:
    """A server of health checking alone on `address`, SERVING or NOT_SERVING."""
    health = WatchedHealth()
    status = health_pb2.HealthCheckResponse
    await health.set("", status.SERVING if serving else status.NOT_SERVING)
    server = aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(address)
    await server.start()
    return server, health


async def restart_serving(address: str) -> aio.Server:
    """Not serving until a watcher is watching; then stopped (cutting the watch) and started
    again, serving, on the same address: a server restarting while a client waits for it."""
    server, health = await health_server(address, serving=False)
    await health.watched.wait()
    await server.stop(grace=0)
    restarted, _ = await health_server(address, serving=True)
    return restarted
