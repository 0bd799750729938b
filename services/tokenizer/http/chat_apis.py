"""OpenAI's Responses API and Anthropic's Messages API: each request the chat completion of its
conversation (responses.py, messages.py), answered in the API's own form (responses_output.py,
messages_output.py); and each API's count of a request's prompt tokens, not run.

    POST /v1/responses, POST /v1/responses/input_tokens
    POST /v1/messages,  POST /v1/messages/count_tokens   (errors in Anthropic's body)
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from fastapi import APIRouter, Request, Response

from engine.errors import InvalidRequest
from services.tokenizer.admission import Admission
from services.tokenizer.http.convert import Plan, chat_plan
from services.tokenizer.http.messages import (
    CountTokensRequest,
    MessagesError,
    MessagesRequest,
    TokensCount,
)
from services.tokenizer.http.messages import chat_form as message_chat
from services.tokenizer.http.messages import renamed as message_renamed
from services.tokenizer.http.messages_output import MessageAnswer
from services.tokenizer.http.responses import (
    ChatForm,
    InputTokens,
    InputTokensRequest,
    ResponsesRequest,
    chat_form,
    renamed,
)
from services.tokenizer.http.responses_output import ResponseAnswer
from services.tokenizer.http.tool_formats import ToolFormat
from services.tokenizer.http.truncation import truncated
from services.tokenizer.tokenizing import tokenize
from tandem.v1 import generation_pb2 as pb

MESSAGES = "/v1/messages"


class Answer(Protocol):
    """A chat completion's answer as another API gives it (responses_output.py,
    messages_output.py): whole, or as its own events from the chat's chunks."""

    def whole(self, completion: dict[str, Any]) -> dict[str, Any]: ...
    def begin(self) -> list[dict[str, Any]]: ...
    def events(self, chunk: dict[str, Any]) -> list[dict[str, Any]]: ...
    def end(self) -> list[dict[str, Any]]: ...
    def error(self, body: dict[str, Any]) -> dict[str, Any]: ...


# app.py's: a plan served, its chat completion answered as `answer` gives it.
Serve = Callable[[Request, Plan, Answer], Awaitable[Response]]


def chat_api_routes(
    a: Admission,
    serve: Serve,
    errors: dict[int | str, dict[str, Any]],
    tool_form: ToolFormat,
    reasoning: bool,
) -> APIRouter:
    """The routes, below /v1 (whose router checks the key)."""
    router = APIRouter()
    anthropic_errors: dict[int | str, dict[str, Any]] = {
        status: {"model": MessagesError} for status in errors
    }

    def plan_of(chat: Any, request_id: str) -> Plan:
        return chat_plan(chat, request_id, a.model_name, tool_form, reasoning)

    async def counted(plan: Plan) -> int:
        """The prompt tokens the plan's chat runs: its messages and tools through the template."""
        (request,) = plan.requests
        return len(await tokenize(a, pb.TokenizeRequest(chat=request.chat, model=request.model)))

    async def responses_form(body: ResponsesRequest) -> ChatForm:
        """The chat of a Responses request, its oldest turns dropped where it asks for
        truncation auto and does not fit (once the context is known: attached)."""
        form = chat_form(body)
        if body.truncation != "auto" or not a.max_seq_len:
            return form

        async def count(cut: ChatForm) -> int:
            try:
                return await counted(plan_of(cut.chat, "count"))
            except InvalidRequest as err:
                raise renamed(err, cut.where) from None

        return await truncated(form, count, a.max_seq_len)

    @router.post("/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        form = await responses_form(body)
        request_id = request.state.request_id
        answer = ResponseAnswer(body, request_id, a.model_name, a.tokenizer)
        try:
            return await serve(request, plan_of(form.chat, request_id), answer)
        except InvalidRequest as err:
            raise renamed(err, form.where) from None

    @router.post("/responses/input_tokens", response_model=InputTokens)
    async def responses_input_tokens(body: InputTokensRequest) -> dict[str, Any]:
        form = await responses_form(body.as_response())
        try:
            count = await counted(plan_of(form.chat, "count"))
        except InvalidRequest as err:
            raise renamed(err, form.where) from None
        return {"object": "response.input_tokens", "input_tokens": count}

    @router.post("/messages", responses=anthropic_errors)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        form = message_chat(body)
        request_id = request.state.request_id
        answer = MessageAnswer(request_id, a.model_name)
        try:
            return await serve(request, plan_of(form.chat, request_id), answer)
        except InvalidRequest as err:
            raise message_renamed(err, form.where) from None

    @router.post("/messages/count_tokens", response_model=TokensCount, responses=anthropic_errors)
    async def count_message_tokens(body: CountTokensRequest) -> dict[str, Any]:
        form = message_chat(body.as_message())
        try:
            count = await counted(plan_of(form.chat, "count"))
        except InvalidRequest as err:
            raise message_renamed(err, form.where) from None
        return {"input_tokens": count}

    return router


def is_messages(request: Request) -> bool:
    """Whether the request is to Anthropic's routes (its key and its errors' shape)."""
    return request.url.path.startswith(MESSAGES)
