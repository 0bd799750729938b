"""Calls to the public API whose every wait is bounded, judged as outcome.py says.

A stream may be cancelled by the client at a chosen point: after `delay_s` once the first
message arrived (before any token: the request is queued or in prefill), or once it has
`after_tokens` tokens (decode), or `delay_s` after the call started (before the first message:
the tokenizer is still tokenizing or submitting).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from bench.faults.outcome import HANG_S, Outcome, hung, of_error, ok
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(frozen=True)
class CancelAt:
    phase: str  # "submit": delay_s after the call starts; "prefill": delay_s after the first
    # message; "decode": once after_tokens tokens arrived
    delay_s: float = 0.0
    after_tokens: int = 0


def channel(address: str) -> aio.Channel:
    return aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def generate(
    stub: generation_pb2_grpc.GenerationStub | Callable[[Any], aio.UnaryStreamCall],
    request: pb.GenerateRequest | bytes,
    cancel: CancelAt | None = None,
    idle_s: float = HANG_S,
    on_reply: Callable[[int], None] | None = None,
) -> Outcome:
    """`on_reply(tokens so far)` runs after every message."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    # A stub, or a raw multicallable that sends bytes as they are (the fuzzer's).
    call = stub(request) if callable(stub) else stub.Generate(request)
    ttft: float | None = None
    tokens = 0
    cancelled: list[str] = []  # the phase in which the client's cancel() ran

    def cancel_now(phase: str) -> None:
        if not call.done():
            cancelled.append(phase if ttft is None else "decode")
            call.cancel()

    timer = None
    if cancel is not None and cancel.phase == "submit":
        timer = loop.call_later(cancel.delay_s, cancel_now, "submit")
    try:
        async with asyncio.timeout(idle_s) as bound:
            async for reply in call:
                bound.reschedule(loop.time() + idle_s)
                if reply.token_ids and ttft is None:
                    ttft = loop.time() - start
                tokens += len(reply.token_ids)
                if on_reply is not None:
                    on_reply(tokens)
                if reply.finish_reason:
                    return ok(reply.finish_reason, ttft_s=ttft, tokens=tokens)
                if cancel is None or cancelled:
                    continue
                if cancel.phase == "prefill" and timer is None:
                    timer = loop.call_later(cancel.delay_s, cancel_now, "prefill")
                elif cancel.phase == "decode" and tokens >= cancel.after_tokens:
                    cancel_now("decode")
        if cancelled:
            return ok("CANCELLED", ttft_s=ttft, tokens=tokens, cancelled_at=cancelled[0])
        return Outcome("unclear_error", "NO_END", "the stream ended without a finish reason")
    except TimeoutError:
        call.cancel()
        return hung(idle_s, ttft_s=ttft, tokens=tokens)
    except asyncio.CancelledError:
        if not cancelled or asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise
        return ok("CANCELLED", ttft_s=ttft, tokens=tokens, cancelled_at=cancelled[0])
    except aio.AioRpcError as err:
        if cancelled and err.code() == grpc.StatusCode.CANCELLED:
            return ok("CANCELLED", ttft_s=ttft, tokens=tokens, cancelled_at=cancelled[0])
        return of_error(err, ttft_s=ttft, tokens=tokens)
    finally:
        if timer is not None:
            timer.cancel()


async def unary(call: Callable[..., Any], request: object, idle_s: float = HANG_S) -> Outcome:
    """A unary call (stub method or raw multicallable) with a bounded wait."""
    try:
        async with asyncio.timeout(idle_s):
            await call(request)
        return ok()
    except TimeoutError:
        return hung(idle_s)
    except aio.AioRpcError as err:
        return of_error(err)
