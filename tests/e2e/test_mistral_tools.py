"""A Mistral model's whole tool flow through the pipeline, with Mistral NeMo's own chat template
(`--chat-template`, llama.cpp's copy): the reply's calls are written in its form and answered
with ids its template takes back (9 letters and digits), and the next turn, the call and the
tool's answer in it, is rendered by the template itself, as transformers renders it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine import registry
from engine.tokenizer import ChatTemplate, Tokenizer, load_tokenizer
from harness.pipeline import Pipeline, pipeline
from tests.e2e.test_chat_template import ASK, WEATHER

pytestmark = pytest.mark.slow

TEMPLATES = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/"
NEMO = TEMPLATES + "mistralai-Mistral-Nemo-Instruct-2407.jinja"


@pytest.fixture(scope="module")
def template(tandem_home: Path) -> str:
    sdist = registry.download(registry.lookup("llama2").file, tandem_home / "wheels")  # type: ignore[union-attr]
    with registry.open_member(sdist, NEMO) as f:
        return f.read().decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, template: str) -> Iterator[Pipeline]:
    folder = tmp_path_factory.mktemp("mistral")
    (folder / "nemo.jinja").write_text(template, encoding="utf-8")
    with pipeline(folder, "--chat-template", str(folder / "nemo.jinja")) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(default_gguf: Path, template: str) -> Tokenizer:
    tokenizer = load_tokenizer(default_gguf)
    tokenizer.chat_template = ChatTemplate(template)
    return tokenizer


def test_a_call_and_its_answer_go_back_to_the_model_in_its_templates_form(
    served: Pipeline, tokenizer: Tokenizer
) -> None:
    with openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0) as sdk:
        reply = sdk.chat.completions.create(
            model="", messages=ASK, tools=[WEATHER], tool_choice="required",  # type: ignore[arg-type]
            temperature=0, max_tokens=64, parallel_tool_calls=False,
        )  # fmt: skip
    (call,) = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len(call.id) == 9 and call.id.isalnum()
    arguments = json.loads(call.function.arguments)
    history: list[dict[str, Any]] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    root = served.http_url.removesuffix("/v1")
    tokenized = httpx.post(f"{root}/tokenize", json={"messages": history})
    assert tokenized.status_code == 200, tokenized.text
    ids = tokenized.json()["tokens"]
    # What transformers hands the template: the arguments as an object.
    shown = [*history[:1], {**history[1], "tool_calls": [{**call.model_dump(), "function": {
        "name": "get_weather", "arguments": arguments}}]}, history[2]]  # fmt: skip
    assert ids == tokenizer.encode_chat(shown)
    text = tokenizer.decode(ids)
    written = json.dumps({"name": "get_weather", "arguments": arguments})[:-1]
    assert f'[TOOL_CALLS][{written}, "id": "{call.id}"}}]' in text
    assert f'[TOOL_RESULTS]{{"content": {{"sky": "sunny"}}, "call_id": "{call.id}"}}' in text
    asked = {"messages": history, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 4}
    with httpx.Client(base_url=served.http_url, timeout=60) as http:
        answered = http.post("/chat/completions", json=asked)
        assert answered.status_code == 200, answered.text
        assert answered.json()["usage"]["prompt_tokens"] == len(ids)
        history[2]["tool_call_id"] = history[1]["tool_calls"][0]["id"] = "call_1"
        refused = http.post("/chat/completions", json={**asked, "messages": history})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["param"] == "messages" and "length 9" in error["message"]
