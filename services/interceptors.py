"""Server interceptors: turn a servicer's exceptions into gRPC statuses, in one place.

A request whose bytes do not parse (a string that is not UTF-8, a corrupt message) never reaches
a servicer: gRPC would end it UNKNOWN and log a traceback, so it is answered INVALID_ARGUMENT
here, for grpc's own health service too.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

from services.errors import status_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Undecodable:
    """What a request that does not parse is handed to the handler as."""

    message: str


def _tolerant(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if parse is None:
        return None

    def tolerant(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as err:
            return Undecodable(f"request: {err}")

    return tolerant


async def _refuse(request: Any, context: aio.ServicerContext) -> None:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _abort_with(context: aio.ServicerContext, err: Exception, method: str) -> None:
    status = status_of(err)
    if status is None:
        log.exception("internal error in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see server log")
    else:
        await context.abort(*status)


class ErrorInterceptor(aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        method = details.method
        kind = "unary_unary" if handler.unary_unary is not None else "unary_stream"
        inner = getattr(handler, kind)
        wrapped: Callable[..., Any]
        # Health and reflection are grpc's own servicers: coroutines, streaming or not (a
        # streaming one writes with context.write); only undecodable requests are refused.
        if method.startswith("/grpc."):
            if not inspect.iscoroutinefunction(inner):
                return handler

            async def wrapped(request: Any, context: aio.ServicerContext) -> Any:
                await _refuse(request, context)
                return await inner(request, context)

        elif kind == "unary_unary":

            async def wrapped(request: Any, context: aio.ServicerContext) -> Any:
                await _refuse(request, context)
                try:
                    return await inner(request, context)
                except aio.AbortError:
                    raise
                except Exception as err:  # mapped to a status, never sent as str(err) blindly
                    await _abort_with(context, err, method)

        else:

            async def wrapped(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
                await _refuse(request, context)
                try:
                    async for item in inner(request, context):
                        yield item
                except aio.AbortError:
                    raise
                except Exception as err:
                    await _abort_with(context, err, method)

        parse = _tolerant(handler.request_deserializer)
        return handler._replace(request_deserializer=parse, **{kind: wrapped})
