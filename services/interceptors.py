"""Server interceptors: turn a servicer's exceptions into gRPC statuses, in one place."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

from services.errors import status_of

log = logging.getLogger(__name__)


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
        method = details.method
        # Health and reflection are grpc's own servicers (and stream with context.write).
        if handler is None or method.startswith("/grpc."):
            return handler
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: aio.ServicerContext) -> Any:
                try:
                    return await inner_uu(request, context)
                except aio.AbortError:
                    raise
                except Exception as err:  # mapped to a status, never sent as str(err) blindly
                    await _abort_with(context, err, method)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(
                request: Any, context: aio.ServicerContext
            ) -> AsyncIterator[Any]:
                try:
                    async for item in inner_us(request, context):
                        yield item
                except aio.AbortError:
                    raise
                except Exception as err:
                    await _abort_with(context, err, method)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler
