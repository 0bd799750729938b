"""tandem's gRPC `Generate`, through the async `TandemClient`."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from types import TracebackType
from typing import Self

from services.bench.config import BenchConfig
from services.bench.record import Event, RequestFailed
from services.bench.workload import RequestSpec
from services.client import TandemClient
from services.client_types import GenerateOptions, TandemError


class TandemBackend:
    def __init__(self, address: str, config: BenchConfig) -> None:
        self.address = address
        self.config = config
        self._client: TandemClient | None = None

    async def __aenter__(self) -> Self:
        # One channel for every request: HTTP/2 multiplexes the streams, as a real client would.
        self._client = TandemClient(self.address, api_key=self.config.api_key)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def stream(self, spec: RequestSpec) -> AsyncGenerator[Event, None]:
        if self._client is None:
            raise RuntimeError("TandemBackend used outside `async with`")
        options = GenerateOptions(
            max_tokens=spec.max_tokens,
            ignore_eos=self.config.ignore_eos,
            temperature=self.config.temperature,
            priority=spec.priority,
            request_id=f"bench-{spec.index}",
        )
        prompt: str | None = spec.text
        if spec.chat:
            options["messages"] = spec.messages()
            prompt = None
        try:
            async with self._client.generate(prompt, **options) as generation:
                async for delta in generation:
                    usage = delta.usage
                    yield Event(
                        tokens=len(delta.token_ids),
                        finish_reason=delta.finish_reason,
                        prompt_tokens=usage.prompt_tokens if usage else None,
                        completion_tokens=usage.completion_tokens if usage else None,
                        cached_prompt_tokens=usage.cached_prompt_tokens if usage else None,
                    )
        except TandemError as err:
            raise RequestFailed(err.code.name, err.message) from None
