"""An OpenAI-compatible HTTP server (llama.cpp's llama-server, vLLM, ...), streamed over SSE.

OpenAI streams carry text, not token ids: a chunk with text counts as one token, which holds for
servers that send a chunk per token (llama.cpp and vLLM do). A token with no text of its own (a
held-back partial character) merges into the next chunk's gap. Output tokens come from the
`usage` the server reports when asked with `stream_options.include_usage`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from services.bench.config import BenchConfig
from services.bench.record import Event, RequestFailed
from services.bench.workload import RequestSpec

CONNECT_TIMEOUT_S = 10.0
MAX_MESSAGE_CHARS = 300  # of an error body shown in the table


@asynccontextmanager
async def open_openai(base_url: str, config: BenchConfig) -> AsyncIterator[OpenAIBackend]:
    # No read timeout (a long generation is not an error; the runner's --timeout is the
    # limit) and no cap on connections (the runner decides how many are in flight).
    key = config.api_key
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers={"Authorization": f"Bearer {key}"} if key else None,
        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    ) as client:
        model = config.model if config.model is not None else await _served_model(client)
        yield OpenAIBackend(client, config, model)


async def _served_model(client: httpx.AsyncClient) -> str | None:
    # Servers that host one model (llama-server) ignore the name, but an OpenAI-style
    # server that checks it gets the one it lists; failures surface in the requests.
    try:
        reply = await client.get("/v1/models")
        return str(reply.json()["data"][0]["id"]) if reply.status_code == 200 else None
    except (httpx.HTTPError, ValueError, LookupError, TypeError):
        return None


@dataclass
class OpenAIBackend:
    client: httpx.AsyncClient
    config: BenchConfig
    model: str | None  # sent in every body; None: none sent

    def body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": spec.max_tokens,
            "temperature": self.config.temperature,
        }
        if self.model is not None:
            body["model"] = self.model
        if self.config.ignore_eos:
            body["ignore_eos"] = True  # an extension that llama.cpp and vLLM accept
        if self.config.endpoint == "chat":
            body["messages"] = spec.messages()
        else:
            body["prompt"] = spec.text
        return body

    async def stream(self, spec: RequestSpec) -> AsyncGenerator[Event, None]:
        path = "/v1/chat/completions" if self.config.endpoint == "chat" else "/v1/completions"
        finished = False
        try:
            async with self.client.stream("POST", path, json=self.body(spec)) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise RequestFailed(f"HTTP {response.status_code}", _error_text(response.text))
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, `event:` lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = self._event(data)
                    finished = finished or event.finish_reason is not None
                    yield event
        except httpx.HTTPError as err:
            raise RequestFailed(type(err).__name__, str(err) or repr(err)) from None
        if not finished:
            raise RequestFailed("INCOMPLETE", "the stream ended without a finish reason")

    def _event(self, data: str) -> Event:
        try:
            chunk = json.loads(data)
        except ValueError:
            raise RequestFailed("BAD_STREAM", f"not JSON: {data[:MAX_MESSAGE_CHARS]}") from None
        if not isinstance(chunk, dict):
            raise RequestFailed("BAD_STREAM", f"not a JSON object: {data[:MAX_MESSAGE_CHARS]}")
        if "error" in chunk:
            raise RequestFailed("STREAM_ERROR", _error_text(json.dumps(chunk)))
        choice = (chunk.get("choices") or [{}])[0]  # the usage chunk has no choices
        if self.config.endpoint == "chat":
            text = (choice.get("delta") or {}).get("content") or ""
        else:
            text = choice.get("text") or ""
        usage = chunk.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Event(
            tokens=1 if text else 0,
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            cached_prompt_tokens=details.get("cached_tokens"),
        )


def _error_text(body: str) -> str:
    """The server's own message when the body is OpenAI's {"error": {"message": ...}}."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
        if message:
            return str(message)[:MAX_MESSAGE_CHARS]
    except (ValueError, AttributeError):
        pass
    return body.strip()[:MAX_MESSAGE_CHARS] or "(empty body)"
