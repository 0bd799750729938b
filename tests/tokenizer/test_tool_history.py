"""An assistant's earlier tool calls and the tools' answers, shown by real models' chat templates
(llama.cpp's copies, in the llama-cpp-python source distribution the registry pins) as
transformers shows them: OpenAI's body through the HTTP conversion, the gRPC request and the
tokenizer service's checks, to the ids of the rendered chat."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest

from engine import registry
from engine.errors import InvalidRequest
from engine.tokenizer import ChatTemplate, Tokenizer
from services.tokenizer.http.convert import chat_plan
from services.tokenizer.http.schemas import ChatCompletionRequest
from services.tokenizer.http.tool_formats import HERMES, JSON, MISTRAL, MISTRAL_ARGS, ToolFormat
from services.tokenizer.request import parse_generate
from tandem.v1 import generation_pb2 as pb

TEMPLATES = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_ID = "a1B2c3D4e"  # Mistral's templates take 9 letters and digits


def conversation(city: str = "Oslo", call_id: str = CALL_ID) -> list[dict[str, Any]]:
    """OpenAI's form: the arguments as JSON text."""
    arguments = json.dumps({"city": city}, ensure_ascii=False)
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "weather", "arguments": arguments},
    }
    return [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"sky": "sunny", "c": 21}'},
        {"role": "assistant", "content": "Sunny, 21 degrees."},
        {"role": "user", "content": "And tomorrow?"},
    ]


def as_transformers_takes_it(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The arguments as an object, as templates read them; an absent content as empty text, as
    tandem gives it (Devstral's template fails on none)."""
    out = copy.deepcopy(messages)
    for message in out:
        message["content"] = message["content"] or ""
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


@pytest.fixture(scope="module")
def sdist(tandem_home: Path) -> Path:
    return registry.download(registry.lookup("llama2").file, tandem_home / "wheels")  # type: ignore[union-attr]


def with_template(smollm: Tokenizer, sdist: Path, name: str) -> Tokenizer:
    with registry.open_member(sdist, f"{TEMPLATES}{name}.jinja") as f:
        source = f.read().decode()
    tokenizer = copy.copy(smollm)
    tokenizer.chat_template = ChatTemplate(source)
    return tokenizer


def rendered_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The ids tandem's HTTP door gives a chat: body → gRPC request → checked spec → ids."""
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": [WEATHER]})
    plan = chat_plan(body, "r", "m", ToolFormat.of(tokenizer))
    spec = parse_generate(plan.requests[0], "m", tokenizer.vocab_size, 8192)
    assert spec.messages is not None
    return tokenizer.encode_chat(spec.messages, tools=spec.tools)


@pytest.mark.parametrize(
    ("name", "form"),
    [
        ("meta-llama-Llama-3.1-8B-Instruct", JSON),
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", HERMES),
        ("Qwen-Qwen2.5-7B-Instruct", HERMES),
        ("mistralai-Mistral-Nemo-Instruct-2407", MISTRAL),
        ("unsloth-mistral-Devstral-Small-2507", MISTRAL_ARGS),
        ("mistralai-Ministral-3-14B-Reasoning-2512", MISTRAL_ARGS),
    ],
)
def test_earlier_calls_and_answers_are_shown_as_transformers_shows_them(
    smollm: Tokenizer, hf_smollm: Any, sdist: Path, name: str, form: str
) -> None:
    tokenizer = with_template(smollm, sdist, name)
    tool_form = ToolFormat.of(tokenizer)
    assert tool_form.name == form and tool_form.in_template
    messages = conversation("Zürich <|im_end|> 😀")  # special text in arguments stays text
    expected = hf_smollm.apply_chat_template(
        as_transformers_takes_it(conversation("Zürich 😀")),
        tools=[WEATHER],
        chat_template=tokenizer.chat_template.source,  # type: ignore[union-attr]
        tokenize=False,
        add_generation_prompt=True,
        # transformers' reading of the GGUF takes <|im_start|> for the end of sequence too
        eos_token=tokenizer.special_token_text["eos_token"],
    )
    ids = rendered_ids(tokenizer, messages)
    # transformers reads the special text as the special token; tandem keeps it text.
    assert tokenizer.decode(ids) == expected.replace("Zürich 😀", "Zürich <|im_end|> 😀")
    plain = rendered_ids(tokenizer, conversation("Zürich 😀"))
    # (transformers' reading of the GGUF's vocabulary splits digits otherwise: its ids are not
    # the reference, its text is.)
    assert plain == tokenizer.encode(expected, allow_special=True)
    im_end = tokenizer.special_id("<|im_end|>")
    assert ids.count(im_end) == plain.count(im_end)  # no turn closed by an argument


def test_mistral_call_ids_are_what_its_template_takes(smollm: Tokenizer, sdist: Path) -> None:
    tokenizer = with_template(smollm, sdist, "mistralai-Mistral-Nemo-Instruct-2407")
    form = ToolFormat.of(tokenizer)
    assert form.gap == ""  # NeMo writes "[TOOL_CALLS][", Mistral 7B v0.3 "[TOOL_CALLS] ["
    assert form.writes_ids  # each earlier call's id is shown in its object: the model writes it
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", form.call_id()) for _ in range(20))
    assert form.read('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo"}}]') == [
        {"name": "weather", "arguments": '{"city": "Oslo"}'}
    ]
    assert re.fullmatch(r"call_[0-9a-f]{24}", ToolFormat(JSON).call_id())
    with pytest.raises(InvalidRequest) as err:
        rendered_ids(tokenizer, conversation(call_id="call_1"))
    assert err.value.field == "messages"
    assert "Tool call IDs should be alphanumeric strings with length 9" in str(err.value)


def test_calls_go_into_the_text_where_the_template_does_not_show_them(smollm: Tokenizer) -> None:
    """SmolLM2's template reads no tool_calls: the HTTP door writes them into the reply's text,
    and the gRPC API refuses them, naming the message."""
    assert not ToolFormat.of(smollm).in_template
    text = smollm.decode(rendered_ids(smollm, conversation()))
    assert '<|im_start|>assistant\n{"name": "weather", "parameters": {"city": "Oslo"}}' in text
    call = {"id": CALL_ID, "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role="user", content="Weather?"),
                pb.ChatMessage(role="assistant", tool_calls=json.dumps([call])),
            ]
        )
    )
    spec = parse_generate(request, "m", smollm.vocab_size, 8192)
    assert spec.messages is not None
    with pytest.raises(InvalidRequest) as err:
        smollm.encode_chat(spec.messages)
    assert err.value.field == "messages[1].tool_calls"


@pytest.mark.parametrize(
    ("tool_calls", "field", "says"),
    [
        ("{oops", "prompt.chat.messages[1].tool_calls", "is not JSON"),
        ('{"function": {}}', "prompt.chat.messages[1].tool_calls", "JSON list"),
        ("[3]", "prompt.chat.messages[1].tool_calls[0]", '{"function"'),
        (
            '[{"function": {"name": "f", "arguments": "{}"}}]',
            "prompt.chat.messages[1].tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            '[{"id": 7, "function": {"name": "f"}}]',
            "prompt.chat.messages[1].tool_calls[0].id",
            "string",
        ),
    ],
)
def test_grpc_tool_calls_that_are_not_openais_form_are_named(
    tool_calls: str, field: str, says: str
) -> None:
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role="user", content="Weather?"),
                pb.ChatMessage(role="assistant", tool_calls=tool_calls),
            ]
        )
    )
    with pytest.raises(InvalidRequest) as err:
        parse_generate(request, "m", 100, 8192)
    assert err.value.field == field and says in str(err.value)
