"""The OpenAI-compatible HTTP API: routes over the tokenizer's one `Admission`.

    POST /v1/chat/completions, POST /v1/completions   (SSE with "stream": true)
    POST /v1/responses   OpenAI's Responses API, as the chat completion of its input (responses.py)
    POST /v1/messages    Anthropic's Messages API, as the chat completion of its messages
                         (messages.py), its errors in Anthropic's body; its key also as x-api-key
    POST /v1/responses/input_tokens, POST /v1/messages/count_tokens   a request's prompt tokens
                         (those four: chat_apis.py)
    GET  /v1/models, GET /v1/models/{model}
    POST /tokenize, POST /detokenize   (vLLM's)
    GET  /health    200 while attached to a scheduler with a worker, else 503 (no key needed)
    GET  /metrics   the process's Prometheus registry (no key needed)

Each generation request becomes the gRPC API's `GenerateRequest`s (convert.py), run by the same
admission path (generations.py): the same validation, backpressure, priority, tracing and
metrics as gRPC. A client that goes away cancels its request, streamed or not. A body over
the gRPC door's message limit is refused with 413 before it is read whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import EngineError, InvalidRequest
from services.client_types import MAX_MESSAGE_BYTES
from services.errors import Cancelled, ServiceError, Unauthenticated, Unavailable
from services.tokenizer.admission import Admission
from services.tokenizer.auth import ApiKeys
from services.tokenizer.http.body_limit import BodyLimit
from services.tokenizer.http.chat_apis import MESSAGES, Answer, chat_api_routes, is_messages
from services.tokenizer.http.convert import Plan, chat_plan, check_served_model, completion_plan
from services.tokenizer.http.errors import (
    ErrorBody,
    anthropic_error,
    error_body,
    error_headers,
    http_error,
    unknown_route,
    validation_error,
)
from services.tokenizer.http.generations import Generations
from services.tokenizer.http.http_metrics import HttpMetrics
from services.tokenizer.http.output import Output, sse
from services.tokenizer.http.reasoning import reasons
from services.tokenizer.http.responses_output import event_sse
from services.tokenizer.http.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Model,
    ModelList,
)
from services.tokenizer.http.tokenize_routes import tokenize_routes
from services.tokenizer.http.tool_formats import ToolFormat
from shm.errors import ShmError

T = TypeVar("T")
CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)
}


# The output formats whose errors name the plan's format_param where it has one: a tool's
# schema ("required", a named function; "auto", a grammar), structured_outputs.json, an older
# guided_* field.
_NAMED_ELSEWHERE = (
    "output_format.json_schema",
    "output_format.grammar",
    "output_format.regex",
    "output_format.choice",
)


class _RequestId:
    """Takes the caller's X-Request-Id (or makes one) and echoes it on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = given.decode("latin-1") if given else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        echo = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), echo]
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(
    admission: Admission,
    keys: ApiKeys,
    registry: CollectorRegistry,
    body_timeout_s: float = 0.0,
    tool_call_format: str = "auto",
    reasoning_format: str = "auto",
) -> FastAPI:
    """body_timeout_s: how long a request's body may take to arrive (0: no limit);
    tool_call_format: how the model writes tool calls (tool_formats.py; auto: as its chat
    template shows); reasoning_format: whether chat replies' <think> part is their
    reasoning_content (reasoning.py; auto: where the template writes <think>)."""
    tool_form = ToolFormat.of(admission.tokenizer, tool_call_format)
    template = admission.tokenizer.chat_template
    reasoning = reasons(reasoning_format, template.source if template is not None else "")
    app = FastAPI(
        title="tandem",
        summary="OpenAI-compatible API of a tandem server",
        version="1",
        docs_url="/docs",
        redoc_url=None,
    )
    started = int(time.time())
    a = admission

    def shaped(request: Request, body: ErrorBody) -> dict[str, Any]:
        """An error body as the request's API gives it: Anthropic's on its route."""
        return anthropic_error(body) if is_messages(request) else body

    async def error_response(request: Request, err: BaseException) -> JSONResponse:
        chat = request.url.path in (CHAT, RESPONSES, MESSAGES)
        status, body = http_error(err, chat=chat)
        return JSONResponse(
            shaped(request, body), status_code=status, headers=error_headers(status)
        )

    for kind in (ServiceError, EngineError, ShmError, Exception):
        app.add_exception_handler(kind, error_response)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        param, message = validation_error(errors)
        if errors and errors[0].get("type") == "json_invalid":
            body = error_body(400, f"the body is not valid JSON: {message}")
            return JSONResponse(shaped(request, body), 400)
        body = error_body(400, f"{param or 'the body'}: {message}", param or None)
        return JSONResponse(shaped(request, body), 400)

    @app.exception_handler(HTTPException)
    async def http_exception(request: Request, err: HTTPException) -> JSONResponse:
        body = error_body(err.status_code, str(err.detail))
        if type(err) is HTTPException and err.status_code in (404, 405):  # routing's own
            allowed = (err.headers or {}).get("Allow") if err.status_code == 405 else None
            body = unknown_route(request.method, request.url.path, allowed, served_routes())
        return JSONResponse(shaped(request, body), status_code=err.status_code, headers=err.headers)

    def served_routes() -> list[str]:
        """The API's own routes, as "POST /v1/chat/completions" (from the OpenAPI schema: the
        routers' routes are not listed one by one in app.routes)."""
        paths = app.openapi()["paths"]
        return [
            f"{method.upper()} {path}"
            for path, operations in paths.items()
            if path.startswith("/v1/")
            for method in operations
        ]

    def require_key(request: Request, authorization: str | None = Header(default=None)) -> None:
        if keys.allows(authorization):
            return
        if not is_messages(request):
            raise Unauthenticated("a valid API key is required: send `Authorization: Bearer KEY`")
        # Anthropic's SDKs send the key as x-api-key.
        if not keys.allows_key(request.headers.get("x-api-key")):
            raise Unauthenticated(
                "a valid API key is required: send `x-api-key: KEY` or `Authorization: Bearer KEY`"
            )

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if not a.link.attached.is_set():
            body = error_body(503, "the scheduler is (re)starting")
            return JSONResponse(body, status_code=503, headers=error_headers(503))
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], responses=_ERRORS)

    def served_model() -> dict[str, Any]:
        model = a.link.model
        if model is None:
            raise Unavailable("the scheduler is (re)starting")
        return {
            "id": a.model_name,
            "object": "model",
            "created": started,
            "owned_by": "tandem",
            "max_model_len": model.max_seq_len,
        }

    @v1.get("/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served_model()]}

    @v1.get("/models/{model_id:path}", response_model=Model)
    async def model(model_id: str) -> dict[str, Any]:
        check_served_model(model_id, a.model_name)
        return served_model()

    @v1.post("/chat/completions", response_model=ChatCompletion)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        plan = chat_plan(body, request.state.request_id, a.model_name, tool_form, reasoning)
        return await serve(request, plan)

    @v1.post("/completions", response_model=Completion)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serve(request, completion_plan(body, request.state.request_id, a.model_name))

    async def serve(request: Request, plan: Plan, answer: Answer | None = None) -> Response:
        """answer: a chat completion answered as another API's (its route's)."""
        response_id = f"{'chatcmpl' if plan.chat else 'cmpl'}-{request.state.request_id}"
        out = Output(a.tokenizer, response_id, a.model_name, plan)
        route = request.url.path if answer is not None else CHAT if plan.chat else COMPLETIONS
        specs = [a.parse(r) for r in plan.requests]
        generations = Generations(a, specs, request.headers.items(), route)
        try:
            out.on_prompts(await until_disconnected(request, generations.start()))
        except BaseException as err:
            await generations.aclose()
            held = isinstance(err, InvalidRequest) and err.field in _NAMED_ELSEWHERE
            if held and plan.format_param:  # a tool's schema, or structured_outputs.json
                raise InvalidRequest(plan.format_param, str(err).split(": ", 1)[1]) from None
            raise
        if plan.stream:
            events = (
                stream(generations, out) if answer is None else streamed(generations, out, answer)
            )
            return StreamingResponse(events, media_type="text/event-stream")

        async def collect() -> dict[str, Any]:
            async for index, message in generations:
                out.add(index, message)
            return out.whole() if answer is None else answer.whole(out.whole())

        try:
            return JSONResponse(await until_disconnected(request, collect()))
        finally:
            await generations.aclose()

    v1.include_router(chat_api_routes(a, serve, _ERRORS, tool_form, reasoning))
    app.include_router(v1)
    app.include_router(tokenize_routes(a, [Depends(require_key)], _ERRORS, tool_form))
    app.add_middleware(BodyLimit, limit=MAX_MESSAGE_BYTES, timeout_s=body_timeout_s)
    # The documented paths: app.routes holds included routers as entries of their own.
    paths = list(app.openapi()["paths"])
    app.add_middleware(HttpMetrics, count=a.telemetry.metrics.http_response, paths=paths)
    app.add_middleware(_RequestId)
    return app


async def stream(generations: Generations, out: Output) -> AsyncIterator[str]:
    """The SSE events; an error after the first one is sent as an event of its own (the status
    is gone by then), as OpenAI and vLLM do. Starlette cancels this when the client goes."""
    try:
        async for index, message in generations:
            for event in out.stream(index, message):
                yield event
        for event in out.last():
            yield event
    except Exception as err:
        yield sse(http_error(err, out.chat)[1])
    finally:
        await generations.aclose()


async def streamed(generations: Generations, out: Output, answer: Answer) -> AsyncIterator[str]:
    """An answer's events (the Responses or the Messages API's), from the chat chunks of its
    completion."""
    try:
        for event in answer.begin():
            yield event_sse(event)
        async for index, message in generations:
            for chunk in out.chunks(index, message):
                for event in answer.events(chunk):
                    yield event_sse(event)
        for chunk in out.last_chunks():
            for event in answer.events(chunk):
                yield event_sse(event)
        for event in answer.end():
            yield event_sse(event)
    except Exception as err:
        yield event_sse(answer.error(http_error(err, chat=True)[1]))
    finally:
        await generations.aclose()


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled if the client disconnects first (its request then ends as cancelled)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise Cancelled("the client went away")
    return task.result()
