"""Anthropic's Messages API through the pipeline, with Anthropic's own SDK: a message is the chat
completion of the same conversation (its text, its usage), streamed as the Messages events the
SDK assembles; a tool_use goes out and its tool_result comes back; errors are Anthropic's body,
naming the Messages request's fields; the key is taken as x-api-key too, on this route only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from harness.pipeline import Pipeline, pipeline
from tests.e2e.test_chat_template import WEATHER as CHAT_WEATHER

pytestmark = pytest.mark.slow

KEY = "messages-key"
BEARER = {"Authorization": f"Bearer {KEY}"}
FUNCTION: dict[str, Any] = CHAT_WEATHER["function"]  # type: ignore[assignment]
# The chat tests' tool, as the Messages API gives it.
WEATHER = {
    "name": FUNCTION["name"],
    "description": FUNCTION["description"],
    "input_schema": FUNCTION["parameters"],
}
# (the SDK takes temperature no more: it goes as the body's own)
GREEDY: dict[str, Any] = {"model": "", "max_tokens": 12, "extra_body": {"temperature": 0}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    with pipeline(tmp_path_factory.mktemp("messages"), "--api-key", KEY) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(served: Pipeline) -> Iterator[anthropic.Anthropic]:
    root = served.http_url.removesuffix("/v1")
    with anthropic.Anthropic(base_url=root, api_key=KEY, max_retries=0) as client:
        yield client  # (it sends the key as x-api-key)


def chat_of(served: Pipeline, messages: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    asked = {"messages": messages, "temperature": 0, "max_tokens": 12, **more}
    got = httpx.post(f"{served.http_url}/chat/completions", json=asked, headers=BEARER, timeout=60)
    assert got.status_code == 200, got.text
    return got.json()


def input_tokens(usage: anthropic.types.Usage) -> int:
    """The prompt's tokens, those the prefix cache had and the others."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def test_a_message_is_the_chat_completion_of_its_conversation(
    served: Pipeline, sdk: anthropic.Anthropic
) -> None:
    conversation = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ]
    message = sdk.messages.create(
        **GREEDY, system="Answer briefly.", messages=[{"role": "user", "content": "Name a colour."}]
    )
    chat = chat_of(served, conversation)
    said = chat["choices"][0]["message"]["content"]
    (block,) = message.content
    assert block.type == "text" and block.text == said and said
    assert input_tokens(message.usage) == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert message.usage.cache_creation_input_tokens == 0
    cut = chat["choices"][0]["finish_reason"] == "length"
    assert message.stop_reason == ("max_tokens" if cut else "end_turn")
    assert message.role == "assistant" and message.type == "message"
    assert message.model == "smollm2-135m-instruct" and message.id.startswith("msg_")


def test_a_streamed_message_is_the_whole_one_event_by_event(sdk: anthropic.Anthropic) -> None:
    sea = [{"type": "text", "text": "Write about the sea.", "cache_control": {"type": "ephemeral"}}]
    asked: dict[str, Any] = {**GREEDY, "messages": [{"role": "user", "content": sea}]}
    whole = sdk.messages.create(**asked)
    events = list(sdk.messages.create(**asked, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert [deltas] == [b.text for b in whole.content if b.type == "text"]
    with sdk.messages.stream(**asked) as stream:  # the SDK's own assembly of the events
        final = stream.get_final_message()
    blocks = [b.model_dump(exclude_none=True) for b in final.content]
    assert blocks == [b.model_dump(exclude_none=True) for b in whole.content]
    assert final.stop_reason == whole.stop_reason and final.id.startswith("msg_")
    # (the same prompt again finds it in the prefix cache: what it read from there differs)
    assert input_tokens(final.usage) == input_tokens(whole.usage)
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_stop_sequence_ends_the_message_and_is_named(sdk: anthropic.Anthropic) -> None:
    asked: dict[str, Any] = {**GREEDY, "max_tokens": 24, "messages": [ASK]}
    (said,) = sdk.messages.create(**asked).content
    assert said.type == "text"
    words = said.text.split()
    assert len(words) >= 3, said.text
    word = f" {words[2]}"  # the third word, with the space before it
    stopped = sdk.messages.create(**asked, stop_sequences=["\u00a7never", word])
    (text,) = stopped.content
    assert text.type == "text" and text.text == said.text[: said.text.index(word)]
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    with sdk.messages.stream(**asked, stop_sequences=[word]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    (delta,) = [e for e in events if e.type == "message_delta"]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", word)
    assert final.stop_sequence == word
    assert [b.model_dump(exclude_none=True) for b in final.content] == [
        b.model_dump(exclude_none=True) for b in stopped.content
    ]


def test_a_tool_use_goes_out_and_its_result_comes_back(
    served: Pipeline, sdk: anthropic.Anthropic
) -> None:
    calling: dict[str, Any] = {
        **GREEDY, "max_tokens": 64, "messages": [ASK], "tools": [WEATHER],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    }  # fmt: skip
    called = sdk.messages.create(**calling)
    (use,) = called.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert called.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with sdk.messages.stream(**calling) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.input) for b in streamed.content] == [("tool_use", use.input)]  # type: ignore[union-attr]
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}
    replied = sdk.messages.create(
        **GREEDY, tools=[WEATHER],  # type: ignore[list-item]
        messages=[ASK, {"role": "assistant", "content": called.content},
                  {"role": "user", "content": [result]}],  # type: ignore[list-item]
    )  # fmt: skip
    # The same turn in the chat form: the call as the assistant's, its result as the tool's.
    chat = chat_of(
        served,
        [
            ASK,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": use.id, "type": "function",
                "function": {"name": use.name, "arguments": json.dumps(use.input)},
            }]},
            {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"},
        ],
        tools=[CHAT_WEATHER],
    )  # fmt: skip
    assert input_tokens(replied.usage) == chat["usage"]["prompt_tokens"]
    # The same conversation counted, not run (the SDK's messages.count_tokens).
    counted = sdk.messages.count_tokens(
        model="", tools=[WEATHER],  # type: ignore[list-item]
        messages=[ASK, {"role": "assistant", "content": called.content},
                  {"role": "user", "content": [result]}],  # type: ignore[list-item]
    )  # fmt: skip
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        (
            {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
            ]}]},
            "messages[0].content[1].type", "not supported",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "disabled"),
        ({"max_tokens": None}, "max_tokens", "valid integer"),
        ({"max_tokens": 10**9}, "max_tokens", ""),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences", "at most 16 stop strings"),
        ({"top_k": 5, "service_tier": "auto"}, "service_tier", "not a parameter"),
        (
            {"messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "c"}]},
            ]},
            "messages[1].content[0].type", "a user's message",
        ),
    ],
)  # fmt: skip
def test_an_error_is_anthropics_naming_the_messages_field(
    served: Pipeline, body: dict[str, Any], param: str, says: str
) -> None:
    asked = {"model": "", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    got = httpx.post(f"{served.http_url}/messages", json=asked, headers=BEARER, timeout=60)
    assert got.status_code == 400, got.text
    assert got.json()["type"] == "error"
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and says in error["message"]


def test_the_sdk_reads_the_errors(sdk: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        sdk.messages.create(model="claude-x", max_tokens=4, messages=[ASK])  # type: ignore[list-item]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.create(**GREEDY, messages=[ASK], stop_sequences=["x"] * 17)  # type: ignore[list-item]
    assert bad.value.body["error"]["message"].startswith("stop_sequences: ")  # type: ignore[index]


def test_the_key_is_taken_as_x_api_key_on_this_route_only(served: Pipeline) -> None:
    asked = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    url = served.http_url
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": f"Bearer {KEY}x"}):
        got = httpx.post(f"{url}/messages", json=asked, headers=headers, timeout=60)
        assert got.status_code == 401, got.text
        assert got.json()["error"]["type"] == "authentication_error"
        assert "x-api-key" in got.json()["error"]["message"]
    for headers in ({"x-api-key": KEY}, BEARER):
        got = httpx.post(f"{url}/messages", json=asked, headers=headers, timeout=60)
        assert got.status_code == 200, got.text
    chat = {**asked, "messages": [{"role": "user", "content": "hi"}]}
    got = httpx.post(f"{url}/chat/completions", json=chat, headers={"x-api-key": KEY}, timeout=60)
    assert got.status_code == 401 and got.json()["error"]["code"] == "invalid_api_key"


def test_counting_tokens_answers_as_anthropic_does(served: Pipeline) -> None:
    url = f"{served.http_url}/messages/count_tokens"
    asked = {"model": "", "system": "Be brief.", "messages": [ASK]}
    got = httpx.post(url, json=asked, headers={"x-api-key": KEY}, timeout=60)
    assert got.status_code == 200, got.text
    chat = chat_of(served, [{"role": "system", "content": "Be brief."}, ASK])
    assert got.json() == {"input_tokens": chat["usage"]["prompt_tokens"]}
    refused = httpx.post(url, json={**asked, "max_tokens": 4}, headers=BEARER, timeout=60)
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    assert refused.json()["error"]["message"].startswith("max_tokens: ")
    assert httpx.post(url, json=asked, timeout=60).json()["error"]["type"] == "authentication_error"
