"""`tandem serve --chat-template FILE`: the template renders every chat, and what it shows the
model is how replies are read: a Hermes-style template has the default model answer in
<tool_call> tags, which reach the client as OpenAI's tool_calls, and one whose generation
prompt opens <think> (DeepSeek-R1's) has the reply's reasoning in reasoning_content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from engine.tokenizer import ChatTemplate, load_tokenizer
from harness.pipeline import Pipeline, pipeline

pytestmark = pytest.mark.slow

# Hermes' form in ChatML, much shortened: the tools in the system turn, calls in tags; the
# reply opened with <think>, as DeepSeek-R1's template opens it.
TEMPLATE = """{% for m in messages %}<|im_start|>{{ m.role }}
{% if loop.first and tools %}You may call these tools: {{ tools | tojson }}
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call>.
{% endif %}{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    folder = tmp_path_factory.mktemp("template")
    (folder / "hermes.jinja").write_text(TEMPLATE, encoding="utf-8")
    flags = ["--chat-template", str(folder / "hermes.jinja"), "--served-model-name", "hermes-r1"]
    with pipeline(folder, *flags) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(served: Pipeline) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0) as client:
        yield client


def test_the_given_template_renders_the_chat(served: Pipeline, default_gguf: Path) -> None:
    tokenizer = load_tokenizer(default_gguf)
    tokenizer.chat_template = ChatTemplate(TEMPLATE)
    got = httpx.post(f"{served.http_url.removesuffix('/v1')}/tokenize", json={"messages": ASK})
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == tokenizer.encode_chat(ASK)


def test_required_calls_are_written_in_tags_and_read_back(sdk: openai.OpenAI) -> None:
    asked = dict(
        model="", messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0,
        max_tokens=64, parallel_tool_calls=False,
    )  # fmt: skip
    reply = sdk.chat.completions.create(**asked)  # type: ignore[call-overload]
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    chunks = list(sdk.chat.completions.create(**asked, stream=True))  # type: ignore[call-overload]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    (streamed,) = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert streamed.function is not None
    assert json.loads(streamed.function.arguments or "") == arguments  # greedy: the same call
    # What the model wrote, tags and all: the completion of the same prompt, held the same way.
    assert reply.usage is not None and reply.usage.completion_tokens > 12


def test_a_begun_reply_is_continued_as_its_prompt_would_be(
    served: Pipeline, sdk: openai.OpenAI, default_gguf: Path
) -> None:
    """continue_final_message (with echo): the reply the client began is continued, as a
    completion of the same rendered ids continues it, and comes first in the answer."""
    begun = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite colour is"},
    ]
    root = served.http_url.removesuffix("/v1")
    asked = {"messages": begun, "continue_final_message": True}
    ids = httpx.post(f"{root}/tokenize", json=asked).json()["tokens"]
    tokenizer = load_tokenizer(default_gguf)
    tokenizer.chat_template = ChatTemplate(TEMPLATE)
    assert ids == tokenizer.encode_chat(begun, False, continue_final_message=True)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nMy favourite colour is")
    reply = sdk.chat.completions.create(
        model="", messages=begun, max_tokens=8, temperature=0,  # type: ignore[arg-type]
        extra_body={"continue_final_message": True, "echo": True},
    )  # fmt: skip
    plain = sdk.completions.create(model="", prompt=ids, max_tokens=8, temperature=0)
    content = reply.choices[0].message.content or ""
    assert content == "My favourite colour is" + plain.choices[0].text
    assert len(content) > len("My favourite colour is")


def test_a_reply_begun_in_think_is_reasoning(served: Pipeline) -> None:
    """The generation prompt opened <think>: until the model closes it, its reply is its
    reasoning (the default model never does, in a few tokens), whole and streamed."""
    root = served.http_url.removesuffix("/v1")
    sampling = {"max_tokens": 12, "temperature": 0}
    asked = {"messages": ASK, **sampling}
    with httpx.Client(base_url=served.http_url, timeout=60) as http:
        message = http.post("/chat/completions", json=asked).json()["choices"][0]["message"]
        ids = httpx.post(f"{root}/tokenize", json={"messages": ASK}).json()["tokens"]
        plain = http.post("/completions", json={"prompt": ids, **sampling}).json()
        with http.stream("POST", "/chat/completions", json={**asked, "stream": True}) as events:
            lines = [json.loads(x[6:]) for x in events.iter_lines() if x[6:7] == "{"]
    said = plain["choices"][0]["text"]
    assert said and "</think>" not in said
    assert message["reasoning_content"] == said and message["content"] == ""
    deltas = [c["choices"][0]["delta"] for c in lines if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == said
    assert not any(d.get("content") for d in deltas)


def test_the_model_goes_by_its_served_name(sdk: openai.OpenAI) -> None:
    (model,) = sdk.models.list().data
    assert model.id == "hermes-r1"
    reply = sdk.chat.completions.create(model="hermes-r1", messages=ASK, max_tokens=2)
    assert reply.model == "hermes-r1"
    with pytest.raises(openai.NotFoundError, match="this server serves 'hermes-r1'"):
        sdk.chat.completions.create(model="smollm2-135m-instruct", messages=ASK, max_tokens=2)
