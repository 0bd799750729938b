"""`Client`: the blocking twin of `TandemClient`, on grpc's sync API.

No event loop and no thread of ours: grpc's own threads come and go with its calls, and
`close()` (or leaving `with`) closes the one channel.

    with Client("127.0.0.1:50051") as client:
        print(client.complete("The capital of France is", max_tokens=8).text)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Self, Unpack

import grpc
from grpc_health.v1 import health_pb2

from services.client_base import REWATCH_S, ClientBase, GenerationBase, not_ready, watch_again
from services.client_types import Delta, GenerateOptions, GenerationResult, TandemError


class SyncGeneration(GenerationBase):
    """One streaming Generate call: iterate it for deltas; `result` holds the totals so far.

    Leaving a `for` loop early (or on an exception such as Ctrl-C), `close()` or leaving `with`
    cancels the call, and with it the work on the server.
    """

    def __iter__(self) -> Iterator[Delta]:
        # A fresh generator per loop: CPython closes it the moment a loop drops it, which runs
        # this `finally` even while the caller still holds the SyncGeneration.
        try:
            while (delta := self._next()) is not None:
                yield delta
        finally:
            self.cancel()

    def __next__(self) -> Delta:
        delta = self._next()
        if delta is None:
            raise StopIteration
        return delta

    def _next(self) -> Delta | None:
        while not self._done:
            try:
                msg = next(self._call, None)
            except grpc.RpcError as err:
                raise self._failed(err) from None
            if (delta := self._take(msg)) is not None:
                return delta
        return None

    def collect(self) -> GenerationResult:
        for _ in self:
            pass
        return self.result

    close = GenerationBase.cancel

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Client(ClientBase[SyncGeneration]):
    channels = grpc
    generation = SyncGeneration

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def complete(
        self, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerationResult:
        with self.generate(prompt, **options) as generation:
            return generation.collect()

    def wait_ready(self, timeout: float, service: str = "") -> None:
        """Return once the server reports SERVING; TandemError(DEADLINE_EXCEEDED) if not in time."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            watch = self._watch(left, service)
            try:
                for reply in watch:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as err:
                watch_again(err, self.address, timeout)
            finally:
                watch.cancel()
            time.sleep(REWATCH_S)
        raise not_ready(self.address, timeout)

    def connected(self, timeout: float = 0.25) -> bool:
        """Whether the channel is (or within `timeout` becomes) connected to the server."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            return False
        finally:
            ready.cancel()

    def _unary(
        self, method: Any, request: Any, timeout: float | None, value: Callable[[Any], Any]
    ) -> Any:
        try:
            return value(method(request, timeout=timeout, metadata=self._metadata()))
        except grpc.RpcError as err:
            raise TandemError.from_rpc(err) from None
