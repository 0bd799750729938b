"""The one map from errors to gRPC status codes, applied by the servicers' interceptor.

Errors users can act on carry their own message (which names the field). Anything else is a bug
or a fault: the client gets a generic message, the log gets the traceback, and the process keeps
serving.
"""

from __future__ import annotations

import grpc

from engine.errors import EngineError, InvalidRequest, ModelFormatError, ModelNotFound
from shm.errors import ShmError


class ServiceError(Exception):
    """An error raised deliberately by a servicer, with the status code it maps to."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class _FieldError(ServiceError):
    """An error in one field of a request, which its message names first."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidArgument(_FieldError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(_FieldError):
    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class CannotStart(Exception):
    """Settings that cannot work with what a process found as it started (a peer's model, say):
    waiting will not change it, so the process says why and exits with code 2."""


def status_of(err: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status for an error users can act on; None for a bug (reported as INTERNAL)."""
    if isinstance(err, ServiceError):
        return err.code, str(err)
    if isinstance(err, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, ModelNotFound):
        return grpc.StatusCode.NOT_FOUND, str(err)
    if isinstance(err, ModelFormatError | EngineError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(err)
    if isinstance(err, ShmError):
        return grpc.StatusCode.INTERNAL, f"shared memory: {err}"
    return None
