"""Anthropic's Messages request as a chat completion (blocks to messages, errors renamed back),
and a chat completion's answer as the Messages API's: whole, and event by event, each checked
against the Anthropic SDK's own models and assembled by the SDK's own accumulator."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse

from engine.errors import InvalidRequest
from engine.tokenizer import Tokenizer, load_tokenizer
from services.errors import NotFound, Unavailable
from services.tokenizer.auth import ApiKeys
from services.tokenizer.http.convert import chat_plan
from services.tokenizer.http.errors import anthropic_error, error_body, http_error
from services.tokenizer.http.messages import (
    MessagesRequest,
    chat_form,
    messages_field,
    renamed,
)
from services.tokenizer.http.messages_output import MessageAnswer
from services.tokenizer.http.tool_formats import LLAMA_JSON
from tests.tokenizer.answered import answered as shared_answered

# Each event's model in the SDK, by its type.
EVENTS = {
    typing.get_args(kind.model_fields["type"].annotation)[0]: kind
    for kind in typing.get_args(typing.get_args(RawMessageStreamEvent)[0])
}
WEATHER = {"name": "weather", "description": "The weather", "input_schema": {"type": "object"}}


@pytest.fixture(scope="module")
def tokenizer(default_gguf: Path) -> Tokenizer:
    return load_tokenizer(default_gguf)


def request(**body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body}
    )


def test_blocks_become_the_chat_of_the_same_conversation() -> None:
    use = {"type": "tool_use", "id": "c1", "name": "weather", "input": {"city": "Paris"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "A tool knows.", "signature": ""},
            {"type": "text", "text": "Let me see."}, use, {**use, "id": "c2"},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "c2", "is_error": True,
             "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "data"}]},
            {"type": "text", "text": "And tomorrow?"},
        ]},
    ]  # fmt: skip
    system = [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}]
    form = chat_form(request(system=system, messages=messages, tools=[WEATHER]))
    chat = form.chat
    said = [
        (m.role, m.content if isinstance(m.content, str) else [p.text for p in m.content or []],
         m.tool_call_id)
        for m in chat.messages
    ]  # fmt: skip
    assert said == [
        ("system", ["Be", "brief."], None),
        ("user", ["Weather?"], None),
        ("assistant", ["Let me see."], None),  # the thinking left out, the calls its own
        ("tool", "sunny", "c1"),
        ("tool", ["no", "data"], "c2"),
        ("user", ["And tomorrow?"], None),
    ]  # fmt: skip
    calls = chat.messages[2].tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("c1", "weather", '{"city": "Paris"}'),
        ("c2", "weather", '{"city": "Paris"}'),
    ]
    assert form.where == [
        "system", "messages[0]", "messages[1]", "messages[2].content[0]",
        "messages[2].content[1]", "messages[2]",
    ]  # fmt: skip
    assert chat.tools is not None and chat.tools[0].function.parameters == {"type": "object"}
    assert chat.tools[0].function.description == "The weather"
    assert not chat.continue_final_message


def test_options_become_the_chats() -> None:
    chat = chat_form(
        request(
            max_tokens=9, temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["\n\n"],
            stream=True, metadata={"user_id": "u1"}, tools=[WEATHER],
            tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
            thinking={"type": "disabled"},
        )
    ).chat  # fmt: skip
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k) == (9, 0.5, 0.9, 40)
    assert chat.stop == ["\n\n"] and chat.user == "u1" and chat.parallel_tool_calls is False
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "weather"  # type: ignore[union-attr]
    assert chat.stream and chat.stream_options and chat.stream_options.include_usage
    assert chat.stream_options.continuous_usage_stats  # message_start tells the prompt's size
    choices = {"any": "required", "auto": "auto", "none": "none"}
    for given, chats in choices.items():
        form = chat_form(request(tools=[WEATHER], tool_choice={"type": given}))
        assert form.chat.tool_choice == chats and form.chat.parallel_tool_calls is None


def test_a_last_assistant_message_is_a_reply_to_continue() -> None:
    begun = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2,"}]
    chat = chat_form(request(messages=begun)).chat
    assert chat.continue_final_message and chat.add_generation_prompt is False
    # An empty one begins nothing: the answer is the whole turn, as to the user's message.
    thought = [{"type": "thinking", "thinking": "Hm.", "signature": ""}]
    for empty in ("", [], thought):
        form = chat_form(request(messages=[begun[0], {"role": "assistant", "content": empty}]))
        assert [m.role for m in form.chat.messages] == ["user"] and form.where == ["messages[0]"]
        assert not form.chat.continue_final_message


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "disabled"),
        (
            {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Look:"}, {"type": "image", "source": {}},
            ]}]},
            "messages[0].content[1].type", "'image' blocks are not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [
                {"type": "tool_use", "id": "c", "name": "f", "input": {}},
            ]}]},
            "messages[0].content[0].type", "belongs in an assistant's message",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
                {"type": "tool_result", "tool_use_id": "c"},
            ]}]},
            "messages[1].content[0].type", "belongs in a user's message",
        ),
        (
            {"messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "c", "content": [{"type": "image"}]},
            ]}]},
            "messages[0].content[0].content[0].type", "'text'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text", "required",
        ),
        ({"tools": [{**WEATHER, "input_schema": {"type": "string"}}]}, "tools[0].input_schema.type",
         "object"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name", "required"),
        ({"tools": [{**WEATHER, "name": "no spaces"}]}, "tools[0].name", "pattern"),
    ],
)  # fmt: skip
def test_a_request_the_chat_cannot_carry_is_refused_by_name(
    body: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        chat_form(request(**body))
    assert err.value.field == field and says in str(err.value)


def test_the_chats_errors_name_the_messages_fields() -> None:
    where = ["system", "messages[0]", "messages[1].content[2]"]
    assert messages_field("messages[0].content", where) == "system"
    assert messages_field("messages[0].content[1].text", where) == "system[1].text"
    assert messages_field("messages[1].role", where) == "messages[0].role"
    assert messages_field("messages[2].content", where) == "messages[1].content[2].content"
    assert messages_field("messages", where) == "messages"
    assert messages_field("max_completion_tokens", where) == "max_tokens"
    assert messages_field("stop[1]", where) == "stop_sequences[1]"
    assert messages_field("stop_token_ids", where) == "stop_token_ids"
    assert messages_field("tools[1].function.parameters", where) == "tools[1].input_schema"
    assert messages_field("tools[1].function.name", where) == "tools[1].name"
    assert messages_field("tool_choice.function.name", where) == "tool_choice.name"
    assert messages_field("user", where) == "metadata.user_id"
    err = renamed(InvalidRequest("prompt.chat.messages[1].role", "is wrong"), where)
    assert err.field == "messages[0].role" and str(err) == "messages[0].role: is wrong"
    err = renamed(InvalidRequest("sampling.stop", "too many"), where)
    assert str(err) == "stop_sequences: too many"


def answered(
    tokenizer: Tokenizer,
    body: MessagesRequest,
    texts: list[str],
    reasons: bool = False,
    stop_string: str = "",
) -> tuple[list[dict[str, Any]], dict[str, Any], Message]:
    """The streamed events, the whole message of a reply of these texts, and the message the
    SDK assembles from the events."""
    plan = chat_plan(chat_form(body).chat, "r", "m", LLAMA_JSON, reasons)
    streamed, whole = MessageAnswer("r", "m"), MessageAnswer("r", "m")
    events, message = shared_answered(
        tokenizer, plan, streamed, whole, texts, cached=2, stop_string=stop_string
    )
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in events:
        EVENTS[event["type"]].model_validate(event)  # as the SDK reads it
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)  # type: ignore[arg-type]
    Message.model_validate(message)
    assert snapshot is not None
    return events, message, snapshot


def test_a_reasoning_reply_streams_as_a_thinking_block_then_the_text(
    tokenizer: Tokenizer,
) -> None:
    body = request(stream=True)
    texts = ["<think>Add", " them.</think>", "It is", " 4."]
    events, whole, assembled = answered(tokenizer, body, texts, reasons=True)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip
    assert [e["index"] for e in events if "index" in e] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert whole["content"] == [
        {"type": "thinking", "thinking": "Add them.", "signature": ""},
        {"type": "text", "text": "It is 4."},
    ]
    assert whole["stop_reason"] == "end_turn" and whole["id"] == "msg_r"
    assert whole["usage"] == {
        "input_tokens": 1,  # the prompt's 3, less the 2 found in the prefix cache
        "output_tokens": whole["usage"]["output_tokens"],
        "cache_read_input_tokens": 2,
        "cache_creation_input_tokens": 0,
    }
    assert events[0]["message"]["usage"]["input_tokens"] == 3  # none known cached yet
    assert assembled.model_dump(exclude_none=True) == Message.model_validate(whole).model_dump(
        exclude_none=True
    )


def test_calls_stream_as_tool_use_blocks(tokenizer: Tokenizer) -> None:
    body = request(stream=True, tools=[WEATHER], tool_choice={"type": "any"})
    events, whole, assembled = answered(
        tokenizer, body, ['[{"name": "weather", ', '"parameters": {"c": 1}}]']
    )
    (start,) = [e for e in events if e["type"] == "content_block_start"]
    assert start["content_block"]["input"] == {} and start["content_block"]["name"] == "weather"
    (delta,) = [e for e in events if e["type"] == "content_block_delta"]
    assert delta["delta"] == {"type": "input_json_delta", "partial_json": '{"c": 1}'}
    (use,) = whole["content"]
    assert use["type"] == "tool_use" and use["input"] == {"c": 1}
    assert use["id"].startswith("call_") and whole["stop_reason"] == "tool_use"
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    got = assembled.content[0].model_dump(exclude_none=True)
    assert got == {**use, "id": got["id"]}  # (each Output names its calls anew)


def test_a_stop_sequence_that_ended_the_reply_is_named(tokenizer: Tokenizer) -> None:
    body = request(stream=True, stop_sequences=["\n\n", "END"])
    events, whole, assembled = answered(tokenizer, body, ["It is", " 4."], stop_string="END")
    assert whole["stop_reason"] == "stop_sequence" and whole["stop_sequence"] == "END"
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert assembled.stop_reason == "stop_sequence" and assembled.stop_sequence == "END"
    assert events[0]["message"]["stop_sequence"] is None  # not known when it starts
    # A reply of calls stops for its calls, whatever ended their text.
    tools = request(stream=True, tools=[WEATHER], tool_choice={"type": "any"})
    call = ['[{"name": "weather", "parameters": {"c": 1}}]']
    _, called, _ = answered(tokenizer, tools, call, stop_string="END")
    assert called["stop_reason"] == "tool_use" and called["stop_sequence"] is None


def test_a_reply_cut_short_stops_at_max_tokens() -> None:
    completion = {
        "choices": [{"message": {"role": "assistant", "content": ""}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 8},
    }
    whole = MessageAnswer("r", "m").whole(completion)
    assert whole["stop_reason"] == "max_tokens"
    assert whole["content"] == [{"type": "text", "text": ""}]  # nothing else: an empty text


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (InvalidRequest("max_tokens", "is too big"), 400, "invalid_request_error"),
        (NotFound("model", "no such model"), 404, "not_found_error"),
        (Unavailable("the worker died"), 503, "overloaded_error"),
        (KeyError("secret"), 500, "api_error"),
    ],
)
def test_errors_are_anthropics_body(err: Exception, status: int, kind: str) -> None:
    got, body = http_error(err, chat=True)
    shaped = anthropic_error(body)
    ErrorResponse.model_validate(shaped)
    assert got == status and shaped["type"] == "error" and shaped["error"]["type"] == kind
    assert shaped["error"]["message"] == body["error"]["message"]
    assert MessageAnswer("r", "m").error(body) == shaped  # mid-stream, the same as an event


def test_another_4xx_is_an_invalid_request() -> None:  # e.g. a GET of /v1/messages: 405
    assert anthropic_error(error_body(405, "Method Not Allowed"))["error"] == {
        "type": "invalid_request_error",
        "message": "Method Not Allowed",
    }


def test_a_bare_key_is_one_of_the_keys() -> None:
    keys = ApiKeys(["k1", "k2"])
    assert keys.allows_key("k1") and keys.allows_key("k2")
    for wrong in (None, "", "k", "Bearer k1", "k1 "):
        assert not keys.allows_key(wrong), wrong
    assert ApiKeys([]).allows_key(None)
