"""The admission calls of one HTTP request (one per prompt) as one stream of (choice index,
message): each call is the same `Admission.generate` a gRPC request makes, with its own
`GenerateCall` (span, metrics) parented by the request's `traceparent` header."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterable

from services.tokenizer.admission import Admission
from services.tokenizer.request import GenerateSpec
from tandem.v1 import generation_pb2 as pb

Headers = Iterable[tuple[str, str]]
Item = tuple[int, pb.GenerateResponse]  # (choice index, message)


async def _one(
    admission: Admission, spec: GenerateSpec, headers: Headers, route: str, offset: int
) -> AsyncGenerator[Item, None]:
    # Begun here, not before: a call whose generator never runs never opens a span either.
    with admission.telemetry.begin(headers, route) as call:
        async with contextlib.aclosing(admission.generate(spec, call, None)) as replies:
            async for reply in replies:
                yield offset + reply.index, reply


class Generations:
    def __init__(
        self, admission: Admission, specs: list[GenerateSpec], headers: Headers, route: str
    ) -> None:
        headers = list(headers)
        self._streams = [
            _one(admission, spec, headers, route, p * spec.n) for p, spec in enumerate(specs)
        ]
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> list[pb.GenerateResponse]:
        """Each call up to its first message (its prompt's ids), which it returns: whatever refuses
        the request (a bad field, a full queue, no worker) is raised here, before an HTTP status
        is sent."""
        return [(await anext(stream))[1] for stream in self._streams]

    def __aiter__(self) -> AsyncIterator[Item]:
        if len(self._streams) == 1:
            return self._streams[0]
        return self._merged()

    async def _merged(self) -> AsyncGenerator[Item, None]:
        queue: asyncio.Queue[Item | BaseException | None] = asyncio.Queue()

        async def pump(stream: AsyncGenerator[Item, None]) -> None:
            try:
                async for item in stream:
                    queue.put_nowait(item)
                queue.put_nowait(None)
            except Exception as err:
                queue.put_nowait(err)

        self._tasks = [asyncio.create_task(pump(s)) for s in self._streams]
        running = len(self._tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    async def aclose(self) -> None:
        """Cancels what is still running (a client that went away, or a failed sibling)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()
