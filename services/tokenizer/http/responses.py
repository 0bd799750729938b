"""OpenAI's Responses API (POST /v1/responses) as a chat completion: its input items become the
chat's messages (function calls and their outputs the assistant's tool_calls and the tools'
answers), its tools and text format the chat's, so a response is planned, checked and held as
the chat completion of the same conversation is. tandem keeps no responses: a conversation is
sent whole, as `input`, each time (store and previous_response_id are refused)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InvalidRequest
from services.tokenizer.http.errors import openai_field, validation_error
from services.tokenizer.http.schemas import (
    ChatCompletionRequest,
    FunctionDefinition,
    Seed,
    _Request,
)

_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS = "message.output_text.logprobs"  # what `include` names to have them


class FunctionTool(FunctionDefinition):
    """A function tool, flat as the Responses API gives it (chat nests it under "function")."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]


class NamedFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Request):
    format: TextFormat | None = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None  # taken: tandem pads no event


class ResponsesRequest(_Request):
    model: str | None = None
    # A user's text, or the conversation so far: messages, function calls, their outputs.
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None  # the system message
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Seed | None = None  # vLLM's
    text: TextOptions | None = None
    stream: bool | None = None
    store: bool | None = None  # refused when true: tandem keeps no responses
    previous_response_id: str | None = None  # refused, for the same reason
    truncation: Literal["disabled", "auto"] | None = None  # auto: truncation.py
    metadata: dict[str, str] | None = None  # returned as given
    user: str | None = None
    # OpenAI's, taken and needed by none: tandem has one service tier, its prefix cache keeps
    # every prompt's blocks whatever key they come with, and safety_identifier is as user.
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: ResponsesStreamOptions | None = None
    reasoning: dict[str, Any] | None = None  # refused unless empty
    # More to return: the output text's logprobs; and, taken with nothing to add, the encrypted
    # reasoning a stateless client sends back (tandem's reasoning items are plain text).
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # with the logprobs included


class InputTokensRequest(_Request):
    """POST /v1/responses/input_tokens: the input of a Responses request, counted, not run."""

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    previous_response_id: str | None = None  # refused: tandem keeps no responses
    truncation: Literal["disabled", "auto"] | None = None  # auto: truncation.py
    reasoning: dict[str, Any] | None = None  # refused unless empty

    def as_response(self) -> ResponsesRequest:
        """The Responses request of this input."""
        return ResponsesRequest(**{name: getattr(self, name) for name in type(self).model_fields})


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class ChatForm(BaseModel):
    """A Responses request as the chat completion that answers it, and where each message
    came from (an error naming messages[k] names input[where[k]])."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    chat: ChatCompletionRequest
    where: list[int | None]  # input index of each message; None: instructions


def chat_form(body: ResponsesRequest) -> ChatForm:
    if body.store:
        raise InvalidRequest("store", "tandem keeps no responses: send store false, or leave it")
    if body.previous_response_id is not None:
        raise InvalidRequest(
            "previous_response_id",
            "tandem keeps no responses: send the whole conversation as input",
        )
    if body.reasoning:
        raise InvalidRequest("reasoning", "is not supported yet")
    for i, name in enumerate(body.include or []):
        if name not in (LOGPROBS, "reasoning.encrypted_content"):
            raise InvalidRequest(f"include[{i}]", f"{name!r} is not supported yet")
    messages: list[dict[str, Any]] = []
    where: list[int | None] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        where.append(None)
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    for i, item in enumerate(items):
        message = _message(item, f"input[{i}]", messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
            where.append(i)
    if not messages:
        raise InvalidRequest("input", "holds no message")
    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "parallel_tool_calls", "temperature", "top_p", "seed", "user"):
        if (value := getattr(body, name)) is not None:
            chat[name] = value
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    if LOGPROBS in (body.include or ()):
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs or 0
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in body.tools
        ]
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidRequest("text.format.schema", "is required with type json_schema")
        schema = {"name": fmt.name, "description": fmt.description, "strict": fmt.strict}
        schema = {k: v for k, v in schema.items() if v is not None}
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {**schema, "schema": fmt.schema_},
        }
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # response.completed carries it
    try:
        return ChatForm(chat=ChatCompletionRequest.model_validate(chat), where=where)
    except ValidationError as err:  # what only the chat's schema checks (a message's form)
        param, said = validation_error(err.errors())
        raise InvalidRequest(responses_field(param, where), said) from None


def _message(
    item: dict[str, Any], field: str, last: dict[str, Any] | None
) -> dict[str, Any] | None:
    """An input item as a chat message; a function call joins the assistant turn before it
    (the chat form's one message of text and calls); None for an item that adds none."""
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("system", "developer", "user", "assistant"):
            raise InvalidRequest(f"{field}.role", "must be system, developer, user or assistant")
        return {"role": role, "content": _text(item.get("content"), f"{field}.content")}
    if kind == "function_call":
        call = {
            "id": _string(item, "call_id", field),
            "type": "function",
            "function": {
                "name": _string(item, "name", field),
                "arguments": _string(item, "arguments", field),
            },
        }
        if last is not None and last["role"] == "assistant":
            last["tool_calls"] = [*(last.get("tool_calls") or []), call]
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {
            "role": "tool",
            "tool_call_id": _string(item, "call_id", field),
            "content": output if isinstance(output, str) else _text(output, f"{field}.output"),
        }
    if kind == "reasoning":
        return None  # an earlier turn's reasoning: chat templates leave it out too
    raise InvalidRequest(
        f"{field}.type",
        f"{kind!r} is not supported: message, function_call, function_call_output or reasoning",
    )


def _text(content: Any, field: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(field, "must be text or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"{field}[{j}].type", f"{kind!r} content is not supported yet: only text"
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{field}.{key}", "is required, as text")
    return value


_RENAMED = [
    (re.compile(r"^max_(completion_)?tokens"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
]


def renamed(err: InvalidRequest, where: list[int | None]) -> InvalidRequest:
    """An error of the chat completion, naming the Responses request's field."""
    chat_field = openai_field(err.field, chat=True)
    message = str(err).removeprefix(f"{err.field}: ")
    return type(err)(responses_field(chat_field, where), message)  # its kind (and code) kept


def responses_field(chat_field: str, where: list[int | None]) -> str:
    """A chat completion's field (OpenAI's name) as the Responses request calls it."""
    found = re.match(r"^messages\[(\d+)\]", chat_field)
    if found:
        source = where[int(found[1])] if int(found[1]) < len(where) else None
        rest = chat_field[found.end() :]
        return "instructions" if source is None else f"input[{source}]{rest}"
    if chat_field == "messages":
        return "input"
    for pattern, name in _RENAMED:
        chat_field = pattern.sub(name, chat_field)
    return chat_field
