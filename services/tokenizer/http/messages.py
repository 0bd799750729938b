"""Anthropic's Messages API (POST /v1/messages) as a chat completion: its system prompt, messages
and tools become the chat's (a user's tool_result blocks the tools' answers, an assistant's
tool_use blocks its tool_calls), so a message is planned, checked and held as the chat completion
of the same conversation is. A last assistant message is a reply the client began: continued,
as Anthropic continues it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError

from engine.errors import InvalidRequest
from services.tokenizer.http.errors import openai_field, validation_error
from services.tokenizer.http.schemas import ChatCompletionRequest, _Request


class CacheControl(_Request):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Cached(_Request):
    # Taken, and needed by none: tandem's prefix cache keeps every prompt's blocks, marked or not.
    cache_control: CacheControl | None = None


class TextBlock(_Cached):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Cached):  # an assistant's call
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Cached):  # a user's answer to a call
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    # Taken, not passed on: a chat's tool message has no such flag; the content says what failed.
    is_error: bool | None = None


class ThinkingBlock(_Request):  # an assistant's earlier reasoning, as tandem answered it
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class Message(_Request):
    role: Literal["user", "assistant"]
    # Text, or blocks: text, tool_use (an assistant's), tool_result (a user's); others refused.
    content: str | list[dict[str, Any]]


class Tool(_Cached):
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]  # a JSON Schema of type object


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type tool's
    disable_parallel_tool_use: bool | None = None


class Metadata(_Request):
    user_id: str | None = None


class MessagesRequest(_Cached):
    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)]  # required, as Anthropic requires it
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    thinking: dict[str, Any] | None = None  # refused unless disabled


class CountTokensRequest(_Cached):
    """POST /v1/messages/count_tokens: the prompt of a Messages request, counted, not run."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None

    def as_message(self) -> MessagesRequest:
        """The Messages request of this prompt (what it generates does not change it)."""
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        return MessagesRequest(**fields, max_tokens=1)


class TokensCount(BaseModel):
    input_tokens: int


class MessagesErrorDetail(BaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    message: str  # beginning with the field it names, if it names one: "max_tokens: ..."


class MessagesError(BaseModel):  # Anthropic's error body (errors.anthropic_error's)
    type: Literal["error"]
    error: MessagesErrorDetail


@dataclass(frozen=True)
class MessagesChat:
    """A Messages request as the chat completion that answers it, and where each chat message
    came from (an error naming messages[k] names where[k])."""

    chat: ChatCompletionRequest
    where: list[str]  # e.g. "system", "messages[2]", "messages[3].content[0]" (a tool_result)


def chat_form(body: MessagesRequest) -> MessagesChat:
    if body.thinking and body.thinking.get("type") != "disabled":
        raise InvalidRequest("thinking", 'is not supported yet: give {"type": "disabled"}')
    messages: list[dict[str, Any]] = []
    where: list[str] = []
    if body.system is not None:
        system = body.system
        content = system if isinstance(system, str) else [_part(b) for b in system]
        messages.append({"role": "system", "content": content})
        where.append("system")
    for i, message in enumerate(body.messages):
        for chat_message, source in _messages(message, f"messages[{i}]"):
            messages.append(chat_message)
            where.append(source)
    chat: dict[str, Any] = {"messages": messages, "max_tokens": body.max_tokens}
    for name in ("model", "temperature", "top_p", "top_k"):
        if (value := getattr(body, name)) is not None:
            chat[name] = value
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    if body.metadata is not None and body.metadata.user_id is not None:
        chat["user"] = body.metadata.user_id
    if body.tools:
        chat["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat.update(_tool_choice(body.tool_choice))
    last = messages[-1]
    if last["role"] == "assistant" and not last.get("tool_calls"):
        if any(part["text"] for part in last["content"] or []):
            chat["continue_final_message"] = True  # a prefilled reply: the answer goes on from it
            chat["add_generation_prompt"] = False
        elif len(messages) > 1:  # an empty one (Anthropic takes it): the answer is the whole turn
            messages.pop()
            where.pop()
    if body.stream:
        chat["stream"] = True
        # Every chunk with the usage so far: message_start, the first event, tells the prompt's.
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    try:
        return MessagesChat(ChatCompletionRequest.model_validate(chat), where)
    except ValidationError as err:  # what only the chat's schema checks
        param, said = validation_error(err.errors())
        raise InvalidRequest(messages_field(param, where), said) from None


def _messages(message: Message, field: str) -> list[tuple[dict[str, Any], str]]:
    """A message as chat messages, each with its source: a user's text between tool_result
    blocks becomes messages of its own, as the results become tool messages, in their order."""
    blocks = message.content
    if isinstance(blocks, str):
        blocks = [{"type": "text", "text": blocks}]
    if message.role == "assistant":
        return [(_assistant(blocks, field), field)]
    out: list[tuple[dict[str, Any], str]] = []
    text: list[dict[str, str]] = []
    for j, block in enumerate(blocks):
        match _block(block, f"{field}.content[{j}]", ("text", "tool_result")):
            case TextBlock() as part:
                text.append(_part(part))
            case ToolResultBlock() as result:
                if text:
                    out.append(({"role": "user", "content": text}, field))
                    text = []
                answer = result.content or ""
                said = answer if isinstance(answer, str) else [_part(b) for b in answer]
                tool = {"role": "tool", "tool_call_id": result.tool_use_id, "content": said}
                out.append((tool, f"{field}.content[{j}]"))
    if text or not out:
        out.append(({"role": "user", "content": text}, field))
    return out


def _assistant(blocks: list[dict[str, Any]], field: str) -> dict[str, Any]:
    text: list[dict[str, str]] = []
    calls = []
    for j, block in enumerate(blocks):
        match _block(block, f"{field}.content[{j}]", ("text", "tool_use", "thinking")):
            case TextBlock() as part:
                text.append(_part(part))
            case ToolUseBlock() as use:
                function = {"name": use.name, "arguments": json.dumps(use.input)}
                calls.append({"id": use.id, "type": "function", "function": function})
            # A thinking block (an earlier turn's reasoning) is left out, as templates leave it.
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return message


Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
_BLOCKS: dict[str, type[Block]] = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
}
_WHOSE = {"tool_use": "an assistant's", "tool_result": "a user's", "thinking": "an assistant's"}


def _block(block: dict[str, Any], field: str, allowed: tuple[str, ...]) -> Block:
    kind = block.get("type")
    if not isinstance(kind, str) or kind not in _BLOCKS:
        raise InvalidRequest(
            f"{field}.type",
            f"{kind!r} blocks are not supported yet: text, tool_use, tool_result (and thinking, "
            "given back)",
        )
    if kind not in allowed:
        raise InvalidRequest(f"{field}.type", f"a {kind} block belongs in {_WHOSE[kind]} message")
    try:
        return _BLOCKS[kind].model_validate(block)
    except ValidationError as err:
        param, said = validation_error(err.errors())
        raise InvalidRequest(f"{field}.{param}" if param else field, said) from None


def _part(block: TextBlock) -> dict[str, str]:
    """A text block as the chat's text part: a message's parts are joined as the chat joins
    them."""
    return {"type": "text", "text": block.text}


def _tool(tool: Tool, field: str) -> dict[str, Any]:
    if tool.input_schema.get("type") != "object":
        raise InvalidRequest(f"{field}.input_schema.type", 'must be "object"')
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> dict[str, Any]:
    chat: dict[str, Any] = {}
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest("tool_choice.name", "is required with type tool")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        chat["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
    if choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    return chat


_RENAMED = [
    (re.compile(r"^max_(completion_)?tokens"), "max_tokens"),
    (re.compile(r"^stop(?=\[|$)"), "stop_sequences"),
    (re.compile(r"^user$"), "metadata.user_id"),
    (re.compile(r"^parallel_tool_calls$"), "tool_choice.disable_parallel_tool_use"),
    (re.compile(r"^tool_choice\.function\.name$"), "tool_choice.name"),
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
]


def renamed(err: InvalidRequest, where: list[str]) -> InvalidRequest:
    """An error of the chat completion, naming the Messages request's field."""
    chat_field = openai_field(err.field, chat=True)
    message = str(err).removeprefix(f"{err.field}: ")
    return type(err)(messages_field(chat_field, where), message)  # its kind (and code) kept


def messages_field(chat_field: str, where: list[str]) -> str:
    """A chat completion's field (OpenAI's name) as the Messages request calls it."""
    found = re.match(r"^messages\[(\d+)\]", chat_field)
    if found:
        k = int(found[1])
        source, rest = where[k] if k < len(where) else "messages", chat_field[found.end() :]
        if source == "system":  # its text, or its blocks: system[j]
            return source + rest.removeprefix(".content")
        return source + rest
    for pattern, name in _RENAMED:
        chat_field = pattern.sub(name, chat_field)
    return chat_field
