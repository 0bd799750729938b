"""API keys at the edge: `Authorization: Bearer KEY` on HTTP (or `x-api-key: KEY`, as Anthropic's
SDKs send it, on Anthropic's Messages API), the same in gRPC metadata.

Keys are compared as SHA-256 digests with `hmac.compare_digest`, against every configured key,
so neither a key's length nor which key nearly matched shows in the time an answer takes.
Health checks stay open (load balancers and the launcher probe them without a key).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from grpc import aio

# gRPC methods that need no key: health checking.
OPEN_METHODS = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED = "a valid API key is required: send `authorization: Bearer KEY`"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """Whether an `Authorization` value carries one of the keys (always, with none set)."""
        if not self._digests:
            return True
        scheme, _, token = (authorization or "").strip().partition(" ")
        return self.allows_key(token.strip()) and scheme.lower() == "bearer"

    def allows_key(self, key: str | None) -> bool:
        """Whether a key given bare (Anthropic's x-api-key) is one of the keys (always, with
        none set)."""
        if not self._digests:
            return True
        given = _digest(key or "")
        matches = [hmac.compare_digest(given, digest) for digest in self._digests]  # no early exit
        return any(matches)


class AuthInterceptor(aio.ServerInterceptor):
    """Refuses a call without a valid key with UNAUTHENTICATED, before its servicer runs."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method: str = details.method
        metadata: Any = details.invocation_metadata or ()
        value = next((v for k, v in metadata if k == "authorization"), None)
        if isinstance(value, bytes):
            value = value.decode(errors="replace")
        handler = await continuation(details)
        if method.startswith(OPEN_METHODS) or self.keys.allows(value):
            return handler
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    async def refuse(request: Any, context: aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    async def refuse_stream(request: Any, context: aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
        yield  # pragma: no cover  (an async generator, as the method is)

    if handler is None:
        return None
    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, des, ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, des, ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, des, ser)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, des, ser)
