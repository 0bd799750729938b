"""One request as the client saw it: when it started, when each token-carrying message came,
how it ended. Backends report `Event`s; the runner stamps them into a `RequestRecord`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    """One message from a server, as far as timing cares."""

    tokens: int = 0  # tokens this message carries (an OpenAI chunk with text counts as one)
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # the server's usage, when this message has it
    completion_tokens: int | None = None
    cached_prompt_tokens: int | None = None  # prompt tokens a prefix cache served


class RequestFailed(Exception):
    """A request the server (or the connection) refused: shown with its status, never dropped."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status  # a gRPC code name, "HTTP 503", or the client-side error's kind
        self.message = message


@dataclass
class RequestRecord:
    index: int
    priority: int
    warmup: bool
    start: float  # seconds since the target's run began
    # (seconds since `start`, tokens) per token-carrying message, in arrival order.
    chunks: list[tuple[float, int]] = field(default_factory=list)
    end: float | None = None  # seconds since `start`, when the stream closed
    finish_reason: str | None = None
    prompt_tokens: int | None = None  # as the server reported it; None if it did not
    usage_tokens: int | None = None  # completion tokens as the server reported them
    cached_prompt_tokens: int | None = None  # prefix-cache hits, where the server says
    status: str | None = None  # None: ok
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status is None

    @property
    def counted_tokens(self) -> int:
        return sum(k for _, k in self.chunks)

    @property
    def output_tokens(self) -> int:
        """The server's count when it gave one (it sees tokens that stream no text), else ours."""
        return self.usage_tokens if self.usage_tokens is not None else self.counted_tokens

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def finished_at(self) -> float | None:
        """Seconds since the target's run began, when the request ended."""
        return None if self.end is None else self.start + self.end

    def itls(self) -> list[float]:
        """Gaps between token-carrying messages; a message with k tokens gives k equal gaps.

        The k tokens of one message were made over the whole gap since the previous message
        and are only seen together, so each is charged gap/k. Extra tokens in the first message
        have no previous message to measure from and give no gap (they count in TTFT).
        """
        out: list[float] = []
        for (t0, _), (t1, k) in zip(self.chunks, self.chunks[1:], strict=False):
            out.extend([(t1 - t0) / k] * k)
        return out

    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2e − TTFT) / (output tokens − 1)."""
        ttft, n = self.ttft, self.output_tokens
        if ttft is None or self.end is None or n < 2:
            return None
        return (self.end - ttft) / (n - 1)

    def observe(self, event: Event, at: float) -> None:
        if event.tokens > 0:
            self.chunks.append((at, event.tokens))
        if event.finish_reason:
            self.finish_reason = event.finish_reason
        if event.prompt_tokens is not None:
            self.prompt_tokens = event.prompt_tokens
        if event.completion_tokens is not None:
            self.usage_tokens = event.completion_tokens
        if event.cached_prompt_tokens is not None:
            self.cached_prompt_tokens = event.cached_prompt_tokens

    def fail(self, err: RequestFailed, at: float) -> None:
        self.status, self.message, self.end = err.status, err.message, at

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "priority": self.priority,
            "warmup": self.warmup,
            "ok": self.ok,
            "status": self.status,
            "message": self.message,
            "start_s": self.start,
            "end_s": self.end,
            "ttft_s": self.ttft,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "output_tokens": self.output_tokens,
            "usage_tokens": self.usage_tokens,
            "counted_tokens": self.counted_tokens,
            "chunks": [[t, k] for t, k in self.chunks],
        }
