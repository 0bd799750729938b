"""Errors as OpenAI's body (`{"error": {"message", "type", "param", "code"}}`) with the HTTP
status users expect. The status follows the gRPC code that services/errors.py gives the same
error, so both doors answer alike; field names are turned into OpenAI's. Anthropic's Messages
API answers its errors in Anthropic's body (anthropic_error)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from engine.errors import ContextLengthExceeded
from services.errors import status_of

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout",
}
ERROR_CODE = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}

# gRPC field names (as parse_generate names them) → OpenAI's, by endpoint.
_FIELDS = [
    (re.compile(r"^sampling\."), ""),
    (re.compile(r"^prompt\.chat\.messages"), "messages"),
    (re.compile(r"^prompt\.chat$"), "messages"),
    (re.compile(r"^prompt(\.text|\.token_ids)?$"), "prompt"),
    (re.compile(r"^output_format\.json_object$"), "response_format"),
    (re.compile(r"^output_format\.json_schema$"), "response_format.json_schema.schema"),
    (re.compile(r"^output_format\.(regex|choice|grammar)$"), r"structured_outputs.\1"),
    (re.compile(r"^output_format$"), "response_format"),
]


def openai_field(field: str, chat: bool) -> str:
    for pattern, name in _FIELDS:
        field = pattern.sub(name, field)
    if chat and field == "prompt":
        return "messages"
    if chat and field == "logprobs":
        return "top_logprobs"
    return field


ErrorBody = dict[str, dict[str, str | int | None]]

# How pydantic names a mismatch of type rather than of value: for a field of several forms (a
# union) each form it is not gives one, so they say least about what the client meant.
_TYPE_MISMATCH = re.compile(r"_type$|_parsing$")


def validation_error(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """The parameter and message of a body that did not validate. A field of several forms
    fails once per form: the error reported is of the same field, a value's limit before a
    mismatch of type, then the one that went deepest into the value (the form meant)."""
    if not errors:
        return "", "is not valid"

    def field(error: Mapping[str, Any]) -> object:
        return next((p for p in error.get("loc", ()) if p != "body"), None)

    same = [e for e in errors if field(e) == field(errors[0])]
    first = max(
        same,
        key=lambda e: (
            _is_kind(e),
            not _TYPE_MISMATCH.search(str(e.get("type"))),
            len(e.get("loc", ())),
        ),
    )
    # The body's own name and the names pydantic gives a union's forms ("list[str]") go.
    path = [p for p in first.get("loc", ()) if p != "body" and not _is_form(p)]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    if first.get("type") == "extra_forbidden":
        return param, "is not a parameter tandem supports"
    return param, str(first.get("msg", "is not valid"))


def _is_kind(error: Mapping[str, Any]) -> bool:
    """An object's `type` that is none of those taken ({"type": "web_search"} among tools that
    must be functions): what the client meant is another kind of thing, which says more than
    the fields that kind lacks."""
    loc = error.get("loc", ())
    return error.get("type") == "literal_error" and bool(loc) and loc[-1] == "type"


def _is_form(part: object) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


# OpenAI's error types as Anthropic's, for its Messages API (a 5xx is api_error, as Anthropic's);
# OpenAI's 404 for an unknown model is an invalid request with code model_not_found.
_ANTHROPIC_TYPE = {
    "invalid_request_error": "invalid_request_error",
    "authentication_error": "authentication_error",
    "permission_error": "permission_error",
    "rate_limit_error": "rate_limit_error",
    "service_unavailable": "overloaded_error",
    "timeout": "timeout_error",
    "error": "invalid_request_error",  # another 4xx: a method not allowed, a path not found
}


def anthropic_error(body: ErrorBody) -> dict[str, Any]:
    """An error body as Anthropic's (`{"type": "error", "error": {"type", "message"}}`)."""
    error = body["error"]
    kind = _ANTHROPIC_TYPE.get(str(error["type"]), "api_error")
    message = str(error["message"])
    if error["code"] == "model_not_found":
        kind = "not_found_error"
    elif error["code"] == ContextLengthExceeded.code:
        message = f"prompt is too long: {message}"  # what Anthropic's clients look for
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> ErrorBody:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "server_error" if status >= 500 else "error"),
            "param": param,
            "code": code or ERROR_CODE.get(status),
        }
    }


# Headers an error's status carries: the scheme a 401 asks for, and when to try again after a
# full queue (429) or while a process restarts (503), which OpenAI's SDKs wait for before retrying.
RETRY_AFTER_S = 1
_HEADERS = {
    401: {"WWW-Authenticate": "Bearer"},
    429: {"Retry-After": str(RETRY_AFTER_S)},
    503: {"Retry-After": str(RETRY_AFTER_S)},
}


def unknown_route(method: str, path: str, allowed: str | None, served: Sequence[str]) -> ErrorBody:
    """The answer to a request routing found no handler for: a path not served (404, as
    OpenAI's "Invalid URL (POST /v1/x)", naming what is served; no code, since an unknown model
    is what model_not_found means), or a method the path does not take (405, naming those it
    does: `allowed`, the Allow header)."""
    if allowed is not None:
        return error_body(405, f"{method} {path} is not allowed: use {allowed}")
    body = error_body(404, f"Invalid URL ({method} {path}): this server serves {', '.join(served)}")
    body["error"]["code"] = None
    return body


def error_headers(status: int) -> dict[str, str] | None:
    return _HEADERS.get(status)


def http_error(err: BaseException, chat: bool) -> tuple[int, ErrorBody]:
    """The status and body for an error raised while serving a request."""
    status = status_of(err)
    if status is None:
        log.error("internal error in an HTTP request", exc_info=err)
        return 500, error_body(500, "internal error; see the server's log")
    code, message = status
    http = HTTP_STATUS.get(code, 500)
    field = getattr(err, "field", None)
    param = None
    if isinstance(field, str):
        param = openai_field(field, chat)
        prefix = f"{field}: "
        if message.startswith(prefix):
            message = f"{param}: {message[len(prefix) :]}"
    code_name = ContextLengthExceeded.code if isinstance(err, ContextLengthExceeded) else None
    return http, error_body(http, message, param, code_name)
