"""OpenAI's Responses API through the pipeline, with OpenAI's own SDK: a response is the chat
completion of the same conversation (its text, its usage), streamed as the Responses events the
SDK assembles; function calls go out as output items and come back as input items; errors name
the Responses request's fields."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from harness.pipeline import Pipeline, pipeline
from tests.e2e.test_chat_template import WEATHER as CHAT_WEATHER

pytestmark = pytest.mark.slow

# The chat tests' tool, flat as the Responses API gives it.
WEATHER: dict[str, Any] = {"type": "function", **CHAT_WEATHER["function"]}  # type: ignore[dict-item]
GREEDY: dict[str, Any] = {"model": "", "temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    with pipeline(tmp_path_factory.mktemp("responses")) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(served: Pipeline) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0) as client:
        yield client


def chat_of(served: Pipeline, messages: list[dict[str, Any]], **more: Any) -> dict[str, Any]:
    asked = {"messages": messages, "temperature": 0, "max_tokens": 12, **more}
    got = httpx.post(f"{served.http_url}/chat/completions", json=asked, timeout=60)
    assert got.status_code == 200, got.text
    return got.json()


def test_a_response_is_the_chat_completion_of_its_input(
    served: Pipeline, sdk: openai.OpenAI
) -> None:
    asked = {"instructions": "Answer briefly.", "input": "Name a colour.", **GREEDY}
    response = sdk.responses.create(**asked)
    chat = chat_of(
        served,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a colour."},
        ],
    )
    said = chat["choices"][0]["message"]["content"]
    assert response.output_text == said and said
    assert response.usage is not None
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    cut = chat["choices"][0]["finish_reason"] == "length"
    assert response.status == ("incomplete" if cut else "completed")
    if cut:
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"


def test_a_streamed_response_is_the_whole_one_event_by_event(sdk: openai.OpenAI) -> None:
    asked = {"input": [{"role": "user", "content": "Write about the sea."}], **GREEDY}
    whole = sdk.responses.create(**asked)
    events = list(sdk.responses.create(**asked, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete" if whole.status == "incomplete" else "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    last = events[-1].response  # type: ignore[union-attr]
    assert last.output_text == whole.output_text and last.usage and whole.usage
    # (the second of the same prompt finds it in the prefix cache: cached_tokens differ)
    assert last.usage.input_tokens == whole.usage.input_tokens
    assert last.usage.output_tokens == whole.usage.output_tokens
    with sdk.responses.stream(**asked) as stream:  # the SDK's own assembly of the events
        *_, end = stream
    assert end.type == events[-1].type
    assert end.response.output_text == whole.output_text  # type: ignore[union-attr]


def test_a_function_call_goes_out_and_its_output_comes_back(
    served: Pipeline, sdk: openai.OpenAI
) -> None:
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    calling: dict[str, Any] = {
        **GREEDY, "max_output_tokens": 64, "input": [ask], "tools": [WEATHER],
        "tool_choice": "required", "parallel_tool_calls": False,
    }  # fmt: skip
    called = sdk.responses.create(**calling)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[arg-type]
    streamed = list(sdk.responses.create(**calling, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]  # type: ignore[union-attr]
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    replied = sdk.responses.create(
        **GREEDY, input=[ask, call.model_dump(exclude_none=True), answer], tools=[WEATHER],  # type: ignore[list-item]
    )  # fmt: skip
    # The same turn in the chat form: the call as the assistant's, its output as the tool's.
    chat = chat_of(
        served,
        [
            ask,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
    )  # fmt: skip
    assert replied.usage is not None
    assert replied.usage.input_tokens == chat["usage"]["prompt_tokens"]
    # The same input counted, not run (the SDK's responses.input_tokens.count).
    counted = sdk.responses.input_tokens.count(
        model="", input=[ask, call.model_dump(exclude_none=True), answer], tools=[WEATHER],  # type: ignore[list-item]
    )  # fmt: skip
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_a_text_format_holds_the_output_to_its_schema(sdk: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    response = sdk.responses.create(
        **{**GREEDY, "max_output_tokens": 40}, input="Name a colour as JSON.",
        text={"format": {"type": "json_schema", "name": "colour", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"store": True}, "store", "keeps no responses"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type", "not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
            "only text",
        ),
        ({"max_output_tokens": 10**9}, "max_output_tokens", ""),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"input": [{"role": "user", "content": "x"}, {"type": "function_call_output"}]},
            "input[1].call_id",
            "required",
        ),
        ({"temperature": -1}, "temperature", "greater than or equal to 0"),
    ],
)  # fmt: skip
def test_an_error_names_the_responses_field(
    served: Pipeline, body: dict[str, Any], param: str, says: str
) -> None:
    asked = {"model": "", "input": "hi", **body}
    got = httpx.post(f"{served.http_url}/responses", json=asked, timeout=60)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == param and says in error["message"]


def test_the_default_model_has_no_tool_template_yet_calls_are_shown(
    served: Pipeline, default_gguf: Path
) -> None:
    """A reasoning item given back is left out, as chat templates leave an earlier turn's."""
    asked = {
        "model": "",
        "input": [
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
            {"role": "user", "content": "Bye"},
        ],
        "max_output_tokens": 2,
    }
    got = httpx.post(f"{served.http_url}/responses", json=asked, timeout=60)
    assert got.status_code == 200, got.text
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    chat.append({"role": "user", "content": "Bye"})
    expected = chat_of(served, chat, max_tokens=2)["usage"]["prompt_tokens"]
    assert got.json()["usage"]["input_tokens"] == expected


def test_counting_tokens_names_the_responses_field_of_an_error(served: Pipeline) -> None:
    asked = {"model": "", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}
    got = httpx.post(f"{served.http_url}/responses/input_tokens", json=asked, timeout=60)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == "input[0].content[0].type"
    many = {"model": "", "input": "hi", "max_output_tokens": 5}  # a Response's, not a count's
    assert httpx.post(f"{served.http_url}/responses/input_tokens", json=many).status_code == 400


def test_openais_fields_tandem_needs_none_of_are_taken(sdk: openai.OpenAI) -> None:
    asked: dict[str, Any] = {"input": "Name a colour.", **GREEDY}
    events = list(
        sdk.responses.create(
            **asked, stream=True, stream_options={"include_obfuscation": False},
            service_tier="auto", prompt_cache_key="conversation-7", safety_identifier="u1",
        )
    )  # fmt: skip
    last = events[-1]  # response.completed, or response.incomplete at max_output_tokens
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.output_text  # type: ignore[union-attr]


def test_the_output_texts_logprobs_come_when_included(sdk: openai.OpenAI) -> None:
    """include message.output_text.logprobs: each token of the text with its logprob and
    top_logprobs alternatives, whole and streamed with the deltas (each answer read against
    itself: two greedy answers to one prompt were seen to part where the prefix cache held
    less of it for one)."""
    asked: dict[str, Any] = {"input": "Name a colour.", **GREEDY}
    included = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    whole = sdk.responses.create(**asked, **included)
    (message,) = whole.output
    part = message.content[0]  # type: ignore[union-attr]
    tokens = part.logprobs or []  # type: ignore[union-attr]
    assert len(tokens) == whole.usage.output_tokens  # type: ignore[union-attr]
    assert b"".join(bytes(t.bytes) for t in tokens).decode() == whole.output_text
    for t in tokens:  # greedy: each token is its position's best
        assert len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob <= 0
    events = list(sdk.responses.create(**asked, **included, stream=True))
    texts = [e for e in events if e.type == "response.output_text.delta"]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    streamed = [t for e in texts for t in e.logprobs]
    assert [t.token for t in streamed] == [t.token for t in done.logprobs]  # type: ignore[union-attr]
    assert b"".join(bytes(t.bytes) for t in streamed).decode() == "".join(e.delta for e in texts)
    assert whole.top_logprobs == 2
    plain = sdk.responses.create(**asked)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]
