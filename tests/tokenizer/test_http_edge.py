"""The HTTP door's pieces without processes: the error map, field names, API keys, refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import llguidance
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException

from engine.errors import InvalidRequest
from engine.guided import OutputFormat, compile_format, grammar_tokenizer
from engine.tokenizer import Tokenizer, load_tokenizer
from services.errors import NotFound, ResourceExhausted, ServiceError, Unauthenticated, Unavailable
from services.tls import TlsSettings
from services.tokenizer.auth import ApiKeys
from services.tokenizer.http.body_limit import BodyLimit
from services.tokenizer.http.convert import (
    Plan,
    chat_plan,
    completion_plan,
    detokenize_request,
    tokenize_request,
)
from services.tokenizer.http.errors import http_error, openai_field
from services.tokenizer.http.http_metrics import HttpMetrics
from services.tokenizer.http.output import Output
from services.tokenizer.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from services.tokenizer.http.server import HttpServer
from services.tokenizer.request import chat_rendering
from tandem.v1 import generation_pb2 as pb
from tests.tokenizer.streamed import streamed


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (InvalidRequest("sampling.top_p", "must be in (0, 1]"), 400, "invalid_request_error"),
        (Unauthenticated("no key"), 401, "authentication_error"),
        (NotFound("model", "no such model"), 404, "invalid_request_error"),
        (ResourceExhausted("8 requests are already waiting"), 429, "rate_limit_error"),
        (Unavailable("the worker died"), 503, "service_unavailable"),
        (ServiceError("late", code=grpc.StatusCode.DEADLINE_EXCEEDED), 504, "timeout"),
    ],
)
def test_errors_map_to_the_status_users_expect(err: Exception, status: int, kind: str) -> None:
    got, body = http_error(err, chat=True)
    assert got == status and body["error"]["type"] == kind


def test_a_bug_is_a_500_without_its_message() -> None:
    status, body = http_error(KeyError("secret internals"), chat=False)
    assert status == 500 and "secret" not in str(body)


def test_grpc_field_names_become_openais() -> None:
    assert openai_field("sampling.temperature", chat=True) == "temperature"
    assert openai_field("prompt.chat.messages[2].role", chat=True) == "messages[2].role"
    assert openai_field("prompt.text", chat=False) == "prompt"
    assert openai_field("prompt.token_ids", chat=True) == "messages"
    assert openai_field("logprobs", chat=True) == "top_logprobs"
    _, body = http_error(InvalidRequest("sampling.top_p", "must be in (0, 1]"), chat=False)
    assert body["error"] == {
        "message": "top_p: must be in (0, 1]",
        "type": "invalid_request_error",
        "param": "top_p",
        "code": None,
    }


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        # A field of several forms: the form the client meant, not the first one tried.
        ({"prompt": [-5]}, "prompt[0]", "greater than or equal to 0"),
        ({"prompt": [[1, 2], [3, -4]]}, "prompt[1][1]", "greater than or equal to 0"),
        ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids[0]", "greater than or equal"),
        ({"prompt": "hi", "max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
        ({"prompt": "hi", "no_such": 1}, "no_such", "is not a parameter tandem supports"),
    ],
)
def test_a_body_that_does_not_validate_is_named_by_its_field(
    body: dict, param: str, message: str
) -> None:
    from pydantic import ValidationError

    from services.tokenizer.http.errors import validation_error

    with pytest.raises(ValidationError) as failed:
        CompletionRequest(**body)
    got_param, got_message = validation_error(failed.value.errors())
    assert got_param == param and message in got_message


def test_a_sampling_field_is_named_once_in_its_error() -> None:
    from services.tokenizer.request import parse_generate

    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=float("inf")))
    with pytest.raises(InvalidRequest) as failed:
        parse_generate(request, "m", 100, 64)
    assert failed.value.field == "sampling.temperature"
    assert str(failed.value) == "sampling.temperature: must be a finite number, got inf"


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"session_id": "s" * 129}, "session_id", "129 characters, at most 128"),
        ({"request_id": "r" * 200}, "request_id", "200 characters, at most 128"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "1025 ids given, at most 1024"),
    ],
)
def test_a_field_past_its_bound_is_named_with_its_size(
    fields: dict, field: str, message: str
) -> None:
    from services.tokenizer.request import parse_generate

    with pytest.raises(InvalidRequest) as failed:
        parse_generate(pb.GenerateRequest(text="hi", **fields), "m", 2000, 64)
    assert failed.value.field == field and str(failed.value) == f"{field}: {message}"


@pytest.mark.parametrize("keep", [-2, 64, 2**31 - 1])
def test_truncate_prompt_tokens_is_held_to_the_context(keep: int) -> None:
    from services.tokenizer.request import parse_generate

    request = pb.GenerateRequest(text="hi", truncate_prompt_tokens=keep)
    with pytest.raises(InvalidRequest) as failed:
        parse_generate(request, "m", 2000, 64)
    assert str(failed.value) == (
        f"truncate_prompt_tokens: must be -1 or in [1, 63] (the context is 64), got {keep}"
    )


def test_a_prompt_of_ids_is_truncated_to_its_last_ones() -> None:
    from services.tokenizer.request import parse_generate

    ids = list(range(1, 101))
    for keep, want in ((5, ids[-5:]), (-1, ids[-63:])):
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), truncate_prompt_tokens=keep)
        assert parse_generate(request, "m", 2000, 64).prompt_ids == want
    with pytest.raises(InvalidRequest, match=r"100 tokens do not fit .*truncate_prompt_tokens"):
        parse_generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids)), "m", 2000, 64)


def test_api_keys() -> None:
    keys = ApiKeys(["k1", "k2"])
    assert keys.required and keys.allows("Bearer k1") and keys.allows("bearer k2")
    for wrong in (None, "", "Bearer", "Bearer k", "Bearer k1x", "Basic k1", "k1"):
        assert not keys.allows(wrong), wrong
    assert ApiKeys([]).allows(None) and not ApiKeys([]).required


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CLOCK = {"type": "function", "function": {"name": "clock"}}


def test_tool_choice_holds_the_output_to_the_calls_json() -> None:
    named = chat(
        tools=[CLOCK, WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}}
    )
    plan = chat_plan(named, "r", "m")
    (request,) = plan.requests
    assert plan.calls is not None and plan.calls.function == "weather"
    assert json.loads(request.output_format.json_schema) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert plan.format_param == "tools[1].function.parameters"
    assert [t["function"]["name"] for t in json.loads(request.chat.tools)] == ["clock", "weather"]
    plan = chat_plan(chat(tools=[CLOCK, WEATHER], tool_choice="required"), "r", "m")
    schema = json.loads(plan.requests[0].output_format.json_schema)
    assert plan.calls is not None and plan.calls.function is None and plan.format_param == "tools"
    oslo = {"name": "weather", "parameters": {"city": "Oslo"}}
    jsonschema.validate(oslo, schema)
    jsonschema.validate([oslo, {"name": "clock", "parameters": {}}], schema)
    for wrong in (
        {"name": "radio", "parameters": {}},
        {"name": "weather", "parameters": {"city": 1}},
        [],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    one = chat_plan(
        chat(tools=[CLOCK, WEATHER], tool_choice="required", parallel_tool_calls=False), "r", "m"
    )
    schema = json.loads(one.requests[0].output_format.json_schema)
    jsonschema.validate(oslo, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([oslo], schema)
    none = chat_plan(chat(tools=[WEATHER], tool_choice="none"), "r", "m")
    assert none.calls is None and none.requests[0].output_format.WhichOneof("format") is None
    assert none.requests[0].chat.tools == ""  # not shown: the model is not to call them


def test_an_assistants_tool_calls_become_its_text() -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = ChatCompletionRequest.model_validate({"messages": messages})
    (request,) = chat_plan(body, "r", "m").requests
    turns = [(m.role, m.content) for m in request.chat.messages]
    assert turns[1] == ("assistant", '{"name": "weather", "parameters": {"city": "Oslo"}}')
    assert turns[2] == ("tool", "sunny")
    for arguments, says in (("{oops", "is not JSON"), ("[1]", "must be a JSON object")):
        call["function"]["arguments"] = arguments  # type: ignore[index]
        with pytest.raises(InvalidRequest, match=says) as err:
            chat_plan(ChatCompletionRequest.model_validate({"messages": messages}), "r", "m")
        assert err.value.field == "messages[1].tool_calls[0].function.arguments"


@pytest.fixture(scope="module")
def vocabulary(default_gguf: Path) -> tuple[Tokenizer, llguidance.LLTokenizer]:
    tokenizer = load_tokenizer(default_gguf)
    return tokenizer, grammar_tokenizer(tokenizer, tokenizer.vocab_size)


def test_tool_choice_auto_holds_a_reply_to_text_or_calls(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer],
) -> None:
    """OpenAI's default: the model answers in text, or calls; a reply that begins as JSON is
    calls, held to the tools' schemas."""
    tokenizer, lltokenizer = vocabulary
    plan = chat_plan(chat(tools=[CLOCK, WEATHER]), "r", "m")
    (request,) = plan.requests
    assert plan.calls is not None and plan.calls.auto and plan.format_param == "tools"
    assert json.loads(request.chat.tools)[1]["function"]["name"] == "weather"
    grammar = compile_format(OutputFormat("grammar", request.output_format.grammar), lltokenizer)

    def whole(text: str) -> bool:
        matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
        ids = tokenizer.encode(text, allow_special=False)
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    call = '{"name": "weather", "parameters": {"city": "Oslo"}}'
    assert whole(call) and whole(f'[{call}, {{"name": "clock", "parameters": {{}}}}]')
    assert whole("It is sunny.") and whole("Sure:\n" + call)  # text, what it holds stays text
    assert not whole('{"name": "radio", "parameters": {}}')  # no such tool
    assert not whole('{"name": "weather", "parameters": {"city": 3}}')  # against its schema
    assert not whole('{"name":"weather","parameters":{}}')  # JSON as the layout writes it only
    assert not whole("[1, 2]")


def test_a_tools_own_definitions_and_references_still_hold(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer],
) -> None:
    """Parameters as pydantic writes them ($defs, $ref, a recursive type): each tool's schema
    moves under the calls' $defs, its references with it."""
    tree = {
        "$defs": {
            "Node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
                },
                "required": ["label"],
            }
        },
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/Node"}, "copy": {"$ref": "#/properties/root"}},
        "required": ["root"],
    }
    shape = {"type": "function", "function": {"name": "draw", "parameters": tree}}
    plan = chat_plan(chat(tools=[shape, WEATHER], tool_choice="required"), "r", "m")
    schema = json.loads(plan.requests[0].output_format.json_schema)
    good = {"name": "draw", "parameters": {"root": {"label": "a", "children": [{"label": "b"}]}}}
    jsonschema.validate(good, schema)
    bad = {"name": "draw", "parameters": {"root": {"label": "a", "children": [{"label": 2}]}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {"name": "draw", "parameters": {"root": {"label": "a"}, "copy": 1}}, schema
        )
    _, lltokenizer = vocabulary
    grammar = compile_format(OutputFormat("json_schema", json.dumps(schema)), lltokenizer)
    tokenizer, _ = vocabulary
    matcher = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    text = '{"name": "draw", "parameters": {"root": {"label": "a", "children": [{"label": "b"}]}}}'
    assert matcher.consume_tokens(tokenizer.encode(text, allow_special=False))
    assert matcher.is_accepting()


def test_a_tools_descriptions_stay_out_of_its_grammar_but_a_property_so_named_stays() -> None:
    note = {
        "type": "function",
        "function": {
            "name": "note",
            "description": "Write a note.",
            "parameters": {
                "type": "object",
                "title": "Note",
                "properties": {
                    "description": {"type": "string", "description": "What the note says."},
                    "tags": {"type": "array", "items": {"enum": ["a", "b"], "title": "Tag"}},
                },
                "required": ["description"],
            },
        },
    }
    plan = chat_plan(chat(tools=[note], tool_choice="required"), "r", "m")
    text = plan.requests[0].output_format.json_schema
    schema = json.loads(text)
    assert "What the note says." not in text and '"title"' not in text
    assert "What the note says." in plan.requests[0].chat.tools  # the model reads them there
    call = {"name": "note", "parameters": {"description": "milk", "tags": ["a"]}}
    jsonschema.validate(call, schema)
    for wrong in (
        {**call, "parameters": {"tags": ["a"]}},
        {**call, "parameters": {"description": "x", "tags": ["c"]}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_tools_with_a_response_format_are_refused_saying_what_to_give() -> None:
    """ "auto" is the default with tools: refused, the message says so and what would do."""
    both = {"tools": [WEATHER], "response_format": {"type": "json_object"}}
    with pytest.raises(InvalidRequest) as err:
        chat_plan(chat(**both), "r", "m")
    assert err.value.field == "tool_choice"
    assert str(err.value).startswith('tool_choice: "auto" (the default with tools) cannot')
    assert chat_plan(chat(**both, tool_choice="none"), "r", "m").calls is None


def test_an_auto_reply_streams_as_text_or_whole_as_calls(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer],
) -> None:
    tokenizer, _ = vocabulary
    plan = chat_plan(chat(tools=[WEATHER], stream=True), "r", "m")
    text = streamed(plan, tokenizer, "", "It is", " {sunny}.")
    assert "".join(c["delta"].get("content") or "" for c in text) == "It is {sunny}."
    assert text[-1]["finish_reason"] == "stop" and not any("tool_calls" in c["delta"] for c in text)
    calls = streamed(plan, tokenizer, '{"name": "weather", ', '"parameters": {"city": "Oslo"}}')
    assert not any(c["delta"].get("content") for c in calls)
    (call,) = calls[-1]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert calls[-1]["finish_reason"] == "tool_calls"
    whole = Output(tokenizer, "id", "m", plan)
    whole.add(0, pb.GenerateResponse(text='[{"name": "weather", "parameters": {}}]'))
    whole.add(0, pb.GenerateResponse(finish_reason="stop"))
    (choice,) = whole.whole()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    cut = Output(tokenizer, "id", "m", plan)  # cut short by max_tokens: it stays text
    cut.add(0, pb.GenerateResponse(text='{"name": "wea', finish_reason="length"))
    (choice,) = cut.whole()["choices"]
    assert choice["message"] == {"role": "assistant", "content": '{"name": "wea'}


def chat(**kw: object) -> ChatCompletionRequest:
    messages = [{"role": "user", "content": "x"}]
    return ChatCompletionRequest.model_validate({"messages": messages, **kw})


def test_chat_converts_to_the_grpc_request() -> None:
    plan = chat_plan(
        chat(
            max_completion_tokens=7, max_tokens=99, temperature=0.5, top_k=-1, seed=3, n=2,
            stop="END", logit_bias={"5": -100}, min_tokens=2, priority=4, logprobs=True,
            stream=True, stream_options={"include_usage": True},
        ),
        "rid",
        "m",
    )  # fmt: skip
    (request,) = plan.requests
    assert request.max_tokens == 7 and request.n == 2 and request.min_tokens == 2
    assert request.sampling.top_k == 0 and request.sampling.seed == 3
    assert dict(request.sampling.logit_bias) == {5: -100.0} and list(request.stop) == ["END"]
    assert request.priority == 4 and request.logprobs == 1 and request.request_id == "rid"
    assert plan.stream and plan.include_usage and plan.top_logprobs == 0 and plan.n == 2


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {
                "tools": [
                    WEATHER,
                    {**CLOCK, "function": {"name": "c", "parameters": {"$defs": [1]}}},
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters.$defs",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"json": {}, "json_object": True}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= x", "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
        ({"best_of": 2}, "best_of"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"seed": -1}, "seed"),
        ({"temperature": 1e308}, "temperature"),
        ({"logit_bias": {"9999999999": 1}}, "logit_bias"),
        ({"modalities": ["audio"]}, "modalities"),
    ],
)
def test_unsupported_chat_parameters_are_refused_by_name(extra: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        chat_plan(chat(**extra), "r", "m")
    assert err.value.field == field
    assert "inf" not in str(err.value)  # the value the client sent, not float32's


def test_output_formats_become_the_grpc_apis_one_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    forms = [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": schema},
                }
            },
            "json_schema",
            json.dumps(schema),
        ),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
        ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", 'root ::= "x"'),
        ({"structured_outputs": {"json": schema}}, "json_schema", json.dumps(schema)),
        (
            {"structured_outputs": {"json": '{"type": "string"}'}},
            "json_schema",
            '{"type": "string"}',
        ),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
    ]
    for extra, kind, value in forms:
        (request,) = chat_plan(chat(**extra), "r", "m").requests
        assert request.output_format.WhichOneof("format") == kind
        if kind is not None:
            assert getattr(request.output_format, kind) == value
    (request,) = completion_plan(
        CompletionRequest(prompt="p", structured_outputs={"choice": ["x", "y"]}), "r", "m"
    ).requests
    assert list(request.output_format.choice.choices) == ["x", "y"]


def test_an_image_is_refused_by_its_place() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    )
    with pytest.raises(InvalidRequest) as err:
        chat_plan(body, "r", "m")
    assert err.value.field == "messages[0].content[0].type"


def test_an_unknown_model_is_not_found() -> None:
    with pytest.raises(NotFound):
        chat_plan(chat(model="gpt-4o"), "r", "m")


def test_completion_prompts() -> None:
    many = completion_plan(CompletionRequest(prompt=["a", "b"], n=2), "rid", "m")
    assert [r.text for r in many.requests] == ["a", "b"]
    assert [r.request_id for r in many.requests] == ["rid:0", "rid:1"]
    assert many.requests[0].max_tokens == 16  # OpenAI's default
    ids = completion_plan(CompletionRequest(prompt=[1, 2, 3]), "rid", "m")
    assert list(ids.requests[0].token_ids.ids) == [1, 2, 3]
    batch = completion_plan(CompletionRequest(prompt=[[1], [2, 3]], logprobs=0), "rid", "m")
    assert len(batch.requests) == 2 and batch.top_logprobs == 0
    with pytest.raises(InvalidRequest, match="suffix"):
        completion_plan(CompletionRequest(prompt="x", suffix="y"), "r", "m")


def test_echo_and_prompt_logprobs_convert_to_scored_prompts() -> None:
    def plan(**fields: Any) -> Plan:
        return completion_plan(CompletionRequest(prompt=["a", "b"], **fields), "r", "m")

    echoed = plan(echo=True, logprobs=2, max_tokens=0)
    assert echoed.echo and not echoed.generates
    # max_tokens 0: one token is made and left out; the prompts are scored with the top 2.
    assert [(r.max_tokens, r.prompt_logprobs) for r in echoed.requests] == [(1, 2), (1, 2)]
    text_only = plan(echo=True)  # no logprobs: nothing to score
    assert not any(r.HasField("prompt_logprobs") for r in text_only.requests)
    both = plan(echo=True, logprobs=1, prompt_logprobs=4)
    assert both.prompt_logprobs == 4 and both.requests[0].prompt_logprobs == 4
    chat_scored = chat_plan(chat(prompt_logprobs=0), "r", "m")
    assert chat_scored.prompt_logprobs == 0 and chat_scored.requests[0].prompt_logprobs == 0
    refused = [
        ({"max_tokens": 0}, "max_tokens", "only with echo"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not with stream"),
        ({"echo": True, "logprobs": 1, "n": 2, "stream": True}, "n", "must be 1 to stream"),
    ]
    for fields, field, message in refused:
        with pytest.raises(InvalidRequest, match=message) as err:
            plan(**fields)
        assert err.value.field == field
    # Streamed echo without logprobs needs no scores: any n.
    assert plan(echo=True, n=2, stream=True).n == 2


def test_tokenize_bodies_convert_to_the_grpc_requests() -> None:
    parts = [{"type": "text", "text": "a"}]
    body = TokenizeRequest.model_validate({"messages": [{"role": "developer", "content": parts}]})
    chat_form = tokenize_request(body, "m")
    assert chat_form.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in chat_form.chat.messages] == [("system", "a")]
    assert tokenize_request(TokenizeRequest(prompt="hi", model="m"), "m").text == "hi"
    both = TokenizeRequest.model_validate({"prompt": "a", "messages": [{"role": "user"}]})
    for neither_or_both in (TokenizeRequest(), both):
        with pytest.raises(InvalidRequest, match="give either a prompt or messages"):
            tokenize_request(neither_or_both, "m")
    with pytest.raises(NotFound):
        tokenize_request(TokenizeRequest(prompt="a", model="gpt-4o"), "m")
    asked = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    shown = tokenize_request(TokenizeRequest.model_validate(asked), "m").chat.tools
    assert [t["function"]["name"] for t in json.loads(shown)] == ["weather"]
    with pytest.raises(InvalidRequest, match="renders messages") as err:
        tokenize_request(TokenizeRequest.model_validate({"prompt": "x", "tools": [WEATHER]}), "m")
    assert err.value.field == "tools"
    assert list(detokenize_request(DetokenizeRequest(tokens=[0, 9]), "m", 10).token_ids) == [0, 9]
    with pytest.raises(InvalidRequest, match=r"ids \[10\] are outside \[0, 10\)") as err:
        detokenize_request(DetokenizeRequest(tokens=[3, 10]), "m", 10)
    assert err.value.field == "tokens"


def _echo_app(limit: int, timeout_s: float = 0.0) -> TestClient:
    """BodyLimit in front of an app that answers with the size of the body it read."""
    app = FastAPI()

    @app.exception_handler(HTTPException)
    async def refused(request: Request, err: HTTPException) -> JSONResponse:
        return JSONResponse({"error": err.detail}, err.status_code, err.headers)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"read": len(await request.body())}

    @app.post("/stream")
    async def stream(request: Request) -> dict[str, str]:
        await request.body()
        message = await request.receive()  # as a streamed response waits for a disconnect
        return {"then": str(message["type"])}

    app.add_middleware(BodyLimit, limit=limit, timeout_s=timeout_s)
    return TestClient(app)


def test_a_body_over_the_limit_is_refused_before_it_is_read_whole() -> None:
    client = _echo_app(limit=100)
    assert client.post("/echo", content=b"x" * 100).json() == {"read": 100}
    by_length = client.post("/echo", content=b"x" * 101)
    assert by_length.status_code == 413
    assert by_length.json()["error"]["message"] == (
        "the body is 101 bytes; this server takes at most 100"
    )


async def _post(
    app: Any, path: str, receive: Callable[[], Awaitable[dict[str, object]]], header: Any
) -> list[dict[str, object]]:
    """The ASGI messages `app` sends for a POST to `path` whose body `receive` gives."""
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [header],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
    }  # fmt: skip
    await app(scope, receive, send)
    return sent


async def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit() -> None:
    """No Content-Length: the bytes are counted as they arrive, and the rest is never read."""
    app = _echo_app(limit=100).app
    pulled = 0

    async def receive() -> dict[str, object]:
        nonlocal pulled
        pulled += 1
        return {"type": "http.request", "body": b"x" * 60, "more_body": pulled < 1000}

    sent = await _post(app, "/echo", receive, (b"content-type", b"application/octet-stream"))
    assert pulled == 2  # 120 bytes read of 60,000
    assert sent[0]["status"] == 413
    message = "the body is more than 100 bytes; this server takes at most 100"
    assert json.loads(sent[1]["body"]) == {"error": message}  # type: ignore[arg-type]


def test_every_response_is_counted_by_its_route_template_and_status() -> None:
    app = FastAPI()

    @app.get("/items/{item}")
    async def item(item: str) -> dict[str, str]:
        return {"item": item}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"read": len(await request.body())}

    counted: list[tuple[str, str, int]] = []
    app.add_middleware(BodyLimit, limit=10)
    paths = list(app.openapi()["paths"])  # as create_app gives them
    app.add_middleware(HttpMetrics, count=lambda *c: counted.append(c), paths=paths)
    client = TestClient(app)
    client.get("/items/42")
    client.post("/echo", content=b"x" * 11)  # refused before routing, by its Content-Length
    client.get("/nowhere")
    client.post("/echo", content=b"x")
    assert counted == [
        ("GET", "/items/{item}", 200),  # the template: ids make no new series
        ("POST", "/echo", 413),
        ("GET", "other", 404),
        ("POST", "/echo", 200),
    ]


async def test_a_body_that_trickles_in_past_the_time_limit_gets_408() -> None:
    """A client that sends its headers and then a byte at a time, slower than the limit allows,
    through uvicorn as the tokenizer serves it: 408 naming the limit, the connection closed,
    and the server answers the next client."""
    app: Any = _echo_app(limit=1000, timeout_s=0.5).app
    server = HttpServer(app, "127.0.0.1", 0, TlsSettings(), grace_s=1)
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        head = b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\n"
        writer.write(head + b"x")
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(b"x")  # still arriving: the limit is the whole body's, not a gap's
        answer = await asyncio.wait_for(reader.read(), 10)  # until the server closes
        writer.close()
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body) == {"error": "the body did not arrive whole within 0.5 s"}
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-length: 3\r\n\r\nabc")
        await writer.drain()
        assert b'{"read":3}' in await asyncio.wait_for(reader.read(1000), 10)
        writer.close()
    finally:
        await server.stop()


async def test_the_time_limit_ends_with_the_body() -> None:
    """Once the body is whole, a later receive (a streamed response waits on it for the
    client's disconnect) is not timed, however late its answer comes."""
    app = _echo_app(limit=1000, timeout_s=0.2).app
    messages = [{"type": "http.request", "body": b"abc", "more_body": False}]

    async def receive() -> dict[str, object]:
        if messages:
            return messages.pop()
        await asyncio.sleep(0.5)
        return {"type": "http.disconnect"}

    sent = await _post(app, "/stream", receive, (b"content-length", b"3"))
    assert sent[0]["status"] == 200
    assert json.loads(sent[1]["body"]) == {"then": "http.disconnect"}  # type: ignore[arg-type]


def test_an_echoed_prompt_leads_each_choice_with_its_scores(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer],
) -> None:
    tokenizer, _ = vocabulary
    ids = tokenizer.encode("Hello there", allow_special=False)
    scores = [
        pb.PromptTokenLogprob(
            token_id=t,
            logprob=-1.5,
            rank=2,
            top_logprobs=[pb.TokenLogprob(token_id=7, logprob=-0.5)],
        )
        for t in ids[1:]
    ]
    first = pb.GenerateResponse(
        text=" you",
        token_ids=[11],
        logprobs=[pb.GeneratedToken(token_id=11, logprob=-0.25)],
        prompt_logprobs=scores,
    )
    last = pb.GenerateResponse(finish_reason="length", usage=pb.Usage(completion_tokens=1))
    header = pb.GenerateResponse(prompt_token_ids=ids)

    def answered(**fields: Any) -> Output:
        plan = completion_plan(CompletionRequest(prompt="Hello there", **fields), "r", "m")
        output = Output(tokenizer, "id", "m", plan)
        output.on_prompts([header])
        return output

    whole = answered(echo=True, logprobs=1, prompt_logprobs=1)
    whole.add(0, pb.GenerateResponse())  # scheduled, nothing yet
    whole.add(0, first)
    whole.add(0, last)
    (choice,) = whole.whole()["choices"]
    texts = [tokenizer.token_bytes(t).decode() for t in ids]
    assert choice["text"] == "Hello there you"
    lp = choice["logprobs"]
    assert lp["tokens"] == [*texts, tokenizer.token_bytes(11).decode()]
    assert lp["token_logprobs"] == [None, *[-1.5] * (len(ids) - 1), -0.25]
    seven = tokenizer.token_bytes(7).decode()
    assert lp["top_logprobs"][:2] == [None, {seven: -0.5}]
    assert lp["text_offset"][-1] == sum(map(len, texts))
    # vLLM's form: by token id, the token's own rank, then its alternatives ranked.
    prompt = choice["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(ids)
    assert prompt[1] == {
        str(ids[1]): {"logprob": -1.5, "rank": 2, "decoded_token": texts[1]},
        "7": {"logprob": -0.5, "rank": 1, "decoded_token": seven},
    }
    # max_tokens 0: the prompt alone, and no completion tokens counted.
    alone = answered(echo=True, logprobs=0, max_tokens=0)
    for msg in (first, last):
        alone.add(0, msg)
    body = alone.whole()
    assert body["choices"][0]["text"] == "Hello there"
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [None, *[-1.5] * (len(ids) - 1)]
    assert body["usage"]["completion_tokens"] == 0
    # Streamed: the prompt in a chunk of its own once the first tokens came, then the rest.
    streamed = answered(echo=True, logprobs=1, stream=True)
    events = [e for msg in (pb.GenerateResponse(), first, last) for e in streamed.stream(0, msg)]
    chunks = [json.loads(e.removeprefix("data: "))["choices"][0] for e in events]
    assert [c["text"] for c in chunks] == ["Hello there", " you", ""]
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert chunks[1]["logprobs"]["text_offset"] == [len("Hello there")]


def test_a_reply_the_client_began_is_continued_and_echoed(
    vocabulary: tuple[Tokenizer, llguidance.LLTokenizer],
) -> None:
    """vLLM's continue_final_message, chat_template_kwargs and chat echo: the options reach
    the gRPC request; echo puts the begun reply first in the answer, whole or streamed."""
    tokenizer, _ = vocabulary
    begun = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "It is"}]
    asked = {"messages": begun, "continue_final_message": True, "echo": True}
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    plan = chat_plan(ChatCompletionRequest.model_validate({**asked, **kwargs}), "r", "m")
    chat = plan.requests[0].chat
    assert chat.continue_final_message and not chat.HasField("add_generation_prompt")
    assert json.loads(chat.chat_template_kwargs) == {"enable_thinking": False}
    rendering = chat_rendering(chat, 1 << 20)
    assert not rendering.add_generation_prompt and rendering.variables == {"enable_thinking": False}
    whole = Output(tokenizer, "id", "m", plan)
    whole.add(0, pb.GenerateResponse(text=" blue.", finish_reason="stop"))
    assert whole.whole()["choices"][0]["message"]["content"] == "It is blue."
    stream = chat_plan(ChatCompletionRequest.model_validate({**asked, "stream": True}), "r", "m")
    chunks = streamed(stream, tokenizer, " blue.")
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "It is blue."
    user_last = {"messages": begun[:1], "echo": True}  # echo needs a begun (assistant) reply
    assert chat_plan(ChatCompletionRequest.model_validate(user_last), "r", "m").chat_echo == ""
    with pytest.raises(InvalidRequest, match="echo: cannot be used with tools"):
        chat_plan(ChatCompletionRequest.model_validate({**asked, "tools": [WEATHER]}), "r", "m")
    with pytest.raises(InvalidRequest, match="continue_final_message: renders messages"):
        tokenize_request(TokenizeRequest(prompt="x", continue_final_message=True), "m")
    bad = pb.ChatMessages(chat_template_kwargs="[1]")
    with pytest.raises(InvalidRequest, match="chat_template_kwargs: must be a JSON object"):
        chat_rendering(bad, 1 << 20)
