"""tandem's gRPC `Generate`, through the async `TandemClient`."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.bench.config import BenchConfig
from services.bench.record import Event, RequestFailed
from services.bench.workload import RequestSpec
from services.client import TandemClient
from services.client_base import answers_not_in_grpc
from services.client_types import GenerateOptions, TandemError


@asynccontextmanager
async def open_tandem(address: str, config: BenchConfig) -> AsyncIterator[TandemBackend]:
    # One channel for every request: HTTP/2 multiplexes the streams, as a real client would.
    async with TandemClient(address, api_key=config.api_key) as client:
        yield TandemBackend(client, config)


@dataclass
class TandemBackend:
    client: TandemClient
    config: BenchConfig

    async def stream(self, spec: RequestSpec) -> AsyncGenerator[Event, None]:
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
            async with self.client.generate(prompt, **options) as generation:
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
            message = err.message
            if answers_not_in_grpc(err):
                message = (
                    f"{self.client.address} answers, but not in gRPC (an HTTP port? "
                    "--backend openai --url http://HOST:PORT benchmarks one)"
                )
            raise RequestFailed(err.code.name, message) from None
