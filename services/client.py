"""An async Python client for the public `tandem.v1.Generation` API.

    async with TandemClient("127.0.0.1:50051") as client:
        await client.wait_ready(timeout=30)
        async for delta in client.generate("The capital of France is", max_tokens=8):
            print(delta.text, end="")

`Client` (from `services.client_sync`, re-exported here) is the blocking twin.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Self, Unpack

from grpc import aio
from grpc_health.v1 import health_pb2

from services.client_base import REWATCH_S, ClientBase, GenerationBase, not_ready, watch_again
from services.client_sync import Client
from services.client_types import (
    Delta,
    GenerateOptions,
    GenerationResult,
    ModelInfo,
    PromptTokenLogprob,
    TandemError,
    TokenLogprob,
    Usage,
)

__all__ = [
    "Client",
    "Delta",
    "GenerateOptions",
    "Generation",
    "GenerationResult",
    "ModelInfo",
    "PromptTokenLogprob",
    "TandemClient",
    "TandemError",
    "TokenLogprob",
    "Usage",
]


class Generation(GenerationBase):
    """One streaming Generate call: iterate it for deltas; `result` holds the totals so far.

    Leaving an `async for` early, `aclose()`, leaving `async with`, or cancelling the task that
    iterates cancels the call, and with it the work on the server.
    """

    async def __aiter__(self) -> AsyncIterator[Delta]:
        # A fresh generator per loop: a loop left early drops it at once, and asyncio then closes
        # it, which runs this `finally` even while the caller still holds the Generation.
        try:
            while (delta := await self._next()) is not None:
                yield delta
        finally:
            self.cancel()

    async def __anext__(self) -> Delta:
        delta = await self._next()
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def _next(self) -> Delta | None:
        while not self._done:
            try:
                msg = await self._call.read()
            except aio.AioRpcError as err:
                raise self._failed(err) from None
            if (delta := self._take(None if msg is aio.EOF else msg)) is not None:
                return delta
        return None

    async def collect(self) -> GenerationResult:
        async for _ in self:
            pass
        return self.result

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class TandemClient(ClientBase[Generation]):
    """One channel to a tandem server. Create it inside the event loop that will use it."""

    channels = aio
    generation = Generation

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def complete(
        self, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerationResult:
        async with self.generate(prompt, **options) as generation:
            return await generation.collect()

    async def wait_ready(self, timeout: float, service: str = "") -> None:
        """Return once the server reports SERVING; TandemError(DEADLINE_EXCEEDED) if not in time."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            watch = self._watch(left, service)
            try:
                async for reply in watch:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except aio.AioRpcError as err:
                watch_again(err, self.address, timeout)
            finally:
                watch.cancel()
            await asyncio.sleep(REWATCH_S)
        raise not_ready(self.address, timeout)

    async def _unary(
        self, method: Any, request: Any, timeout: float | None, value: Callable[[Any], Any]
    ) -> Any:
        try:
            return value(await method(request, timeout=timeout, metadata=self._metadata()))
        except aio.AioRpcError as err:
            raise TandemError.from_rpc(err) from None
