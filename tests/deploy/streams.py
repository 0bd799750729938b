"""Generate calls through the public API, each consumed on a thread of its own.

A stream records what arrived and when (the first token, the end, the status it ended with), so
the driver can act while it runs (kill the worker after a few replies) and time what follows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.deploy.compose_cli import now
from tests.deploy.live_stack import check

MAX_TOKENS = 24
REQUEST_TIMEOUT_S = 120


def request(kind: str, prompt: str, max_tokens: int = MAX_TOKENS, **kw: Any) -> pb.GenerateRequest:
    out = pb.GenerateRequest(max_tokens=max_tokens, sampling=pb.SamplingParams(temperature=0), **kw)
    if kind == "chat":
        out.chat.messages.add(role="user", content=prompt)
    else:
        out.text = prompt
    return out


@dataclass
class Stream:
    """One Generate call, consumed on a thread: what arrived, when, and how it ended."""

    address: str
    request: pb.GenerateRequest
    replies: int = 0
    first_token_at: float = 0.0
    trace_id: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    error: grpc.RpcError | None = None
    ended_at: float = 0.0
    progressed: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    wanted_replies: int = 1

    def start(self) -> Stream:
        threading.Thread(target=self._consume, daemon=True).start()
        return self

    def _consume(self) -> None:
        try:
            with grpc.insecure_channel(self.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for reply in stub.Generate(self.request, timeout=REQUEST_TIMEOUT_S):
                    self.replies += 1
                    self.trace_id = self.trace_id or reply.trace_id
                    self.prompt_ids.extend(reply.prompt_token_ids)
                    if reply.token_ids and not self.first_token_at:
                        self.first_token_at = now()
                    self.token_ids.extend(reply.token_ids)
                    self.text += reply.text
                    self.finish_reason = reply.finish_reason or self.finish_reason
                    if self.replies >= self.wanted_replies:
                        self.progressed.set()
        except grpc.RpcError as err:
            self.error = err
        finally:
            self.ended_at = now()
            self.progressed.set()
            self.done.set()

    def wait(self, timeout: float = REQUEST_TIMEOUT_S + 10) -> Stream:
        check(self.done.wait(timeout), f"a stream from {self.address} did not end in {timeout} s")
        return self

    def status(self) -> str:
        if self.error is None:
            return "OK"
        return f"{self.error.code().name}: {self.error.details()}"  # type: ignore[attr-defined]


def generate(address: str, req: pb.GenerateRequest) -> Stream:
    return Stream(address, req).start().wait()
