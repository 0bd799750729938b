"""The Responses API's request as a chat completion (items to messages, errors renamed back), and
a chat completion's answer as the Responses API's: whole, and event by event, each checked
against the OpenAI SDK's own models of them."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent

from engine.errors import InvalidRequest
from engine.tokenizer import Tokenizer, load_tokenizer
from services.tokenizer.http.convert import chat_plan
from services.tokenizer.http.responses import (
    ResponsesRequest,
    chat_form,
    renamed,
    responses_field,
)
from services.tokenizer.http.responses_output import ResponseAnswer
from services.tokenizer.http.tool_formats import LLAMA_JSON
from tests.tokenizer.answered import answered as shared_answered

# Each event's model in the SDK, by its type.
EVENTS = {
    typing.get_args(kind.model_fields["type"].annotation)[0]: kind
    for kind in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}
WEATHER = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
CALL = {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"c": 1}'}
ANSWER = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}


@pytest.fixture(scope="module")
def tokenizer(default_gguf: Path) -> Tokenizer:
    return load_tokenizer(default_gguf)


def request(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **body})


def test_items_become_the_chat_of_the_same_conversation() -> None:
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        CALL,
        {**CALL, "call_id": "c2"},
        ANSWER,
        {**ANSWER, "call_id": "c2", "output": [{"type": "input_text", "text": "dry"}]},
        CALL,
    ]  # fmt: skip
    form = chat_form(request(instructions="Be brief.", input=items, tools=[WEATHER]))
    chat = form.chat
    said = [(m.role, m.content, m.tool_call_id) for m in chat.messages]
    assert said == [
        ("system", "Be brief.", None),
        ("user", "Weather?", None),
        ("assistant", "Let me see.", None),  # the calls after it join its turn
        ("tool", "sunny", "c1"),
        ("tool", "dry", "c2"),
        ("assistant", None, None),  # a call with no turn before it opens one
    ]
    assert [c.id for c in chat.messages[2].tool_calls or []] == ["c1", "c2"]
    assert form.where == [None, 0, 2, 5, 6, 7]
    assert chat.tools is not None and chat.tools[0].function.name == "weather"


def test_options_become_the_chats() -> None:
    schema = {"type": "object"}
    form = chat_form(
        request(
            max_output_tokens=9, tool_choice={"type": "function", "name": "weather"},
            tools=[WEATHER], text={"format": {"type": "json_schema", "schema": schema}},
            stream=True, temperature=0.5, seed=3,
        )
    )  # fmt: skip
    chat = form.chat
    assert chat.max_completion_tokens == 9 and chat.temperature == 0.5 and chat.seed == 3
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "weather"  # type: ignore[union-attr]
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.schema_ == schema
    assert chat.stream and chat.stream_options and chat.stream_options.include_usage
    plain = chat_form(request(text={"format": {"type": "json_object"}}, include=[])).chat
    assert plain.response_format is not None and plain.response_format.type == "json_object"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        (
            {"include": ["reasoning.encrypted_content", "code_interpreter_call.outputs"]},
            "include[1]",
        ),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ],
)
def test_a_request_the_chat_cannot_carry_is_refused_by_name(
    body: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequest) as err:
        chat_form(request(**body))
    assert err.value.field == field


@pytest.mark.parametrize(
    ("tool", "message"),
    [
        ({"type": "web_search"}, "Input should be 'function'"),  # a built-in tool: its kind
        ({"type": "function"}, "Field required"),  # a function without its name
    ],
)
def test_a_tool_of_another_kind_is_named_by_its_type(tool: dict[str, Any], message: str) -> None:
    from pydantic import ValidationError

    from services.tokenizer.http.errors import validation_error

    with pytest.raises(ValidationError) as failed:
        ResponsesRequest(input="hi", tools=[tool])
    param, got = validation_error(failed.value.errors())
    assert param == ("tools[0].type" if "web" in tool["type"] else "tools[0].name")
    assert message in got


def test_the_chats_errors_name_the_responses_fields() -> None:
    where: list[int | None] = [None, 0, 3]
    assert responses_field("messages[2].content", where) == "input[3].content"
    assert responses_field("messages[0].content", where) == "instructions"
    assert responses_field("messages", where) == "input"
    assert responses_field("max_tokens", where) == "max_output_tokens"
    assert responses_field("response_format.json_schema.schema", where) == "text.format.schema"
    assert responses_field("tools[1].function.parameters", where) == "tools[1].parameters"
    err = renamed(InvalidRequest("prompt.chat.messages[1].role", "is wrong"), where)
    assert err.field == "input[0].role" and str(err) == "input[0].role: is wrong"


def answered(
    tokenizer: Tokenizer, body: ResponsesRequest, texts: list[str], reasons: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The streamed events and the whole response of a reply of these texts, each as the SDK
    reads it."""
    plan = chat_plan(chat_form(body).chat, "r", "m", LLAMA_JSON, reasons)
    streamed, whole = (ResponseAnswer(body, "r", "m", tokenizer) for _ in range(2))
    events, response = shared_answered(tokenizer, plan, streamed, whole, texts)
    for event in events:
        EVENTS[event["type"]].model_validate(event)
    Response.model_validate(response)
    return events, response


def test_a_reasoning_reply_streams_as_a_reasoning_item_then_the_message(
    tokenizer: Tokenizer,
) -> None:
    body = request(stream=True)
    texts = ["<think>Add", " them.</think>", "It is", " 4."]
    events, whole = answered(tokenizer, body, texts, reasons=True)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds.count("response.output_item.added") == 2
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (reasoning, text) == ("Add them.", "It is 4.")
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [
        {**item, "id": final["output"][i]["id"]} for i, item in enumerate(whole["output"])
    ]
    kinds_whole = [(o["type"], o["content"][0]["text"]) for o in whole["output"]]
    assert kinds_whole == [("reasoning", "Add them."), ("message", "It is 4.")]
    usage = final["usage"]
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"]


def test_calls_stream_as_function_call_items(tokenizer: Tokenizer) -> None:
    body = request(stream=True, tools=[WEATHER], tool_choice="required")
    events, whole = answered(tokenizer, body, ['[{"name": "weather", ', '"parameters": {"c": 1}}]'])
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [(i["type"], i["name"], i["arguments"]) for i in added] == [
        ("function_call", "weather", '{"c": 1}')
    ]
    assert added[0]["call_id"].startswith("call_")
    (call,) = whole["output"]
    assert call["type"] == "function_call" and call["arguments"] == '{"c": 1}'
    assert events[-1]["response"]["tool_choice"] == "required"
