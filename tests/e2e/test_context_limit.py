"""A server started with a shorter context (`--max-model-len`): what it reports, what it
refuses, and the Responses API's truncation "auto" keeping a long conversation going inside it,
with OpenAI's own SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from harness.pipeline import Pipeline, pipeline

pytestmark = pytest.mark.slow

CONTEXT = 256
GREEDY: dict[str, Any] = {"model": "", "temperature": 0, "max_output_tokens": 8}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    flags = ("--max-model-len", str(CONTEXT))
    with pipeline(tmp_path_factory.mktemp("context"), *flags) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(served: Pipeline) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0) as client:
        yield client


def conversation(turns: int) -> list[dict[str, Any]]:
    """`turns` questions and answers about numbers (about 25 tokens a turn), then a last one."""
    items: list[dict[str, Any]] = []
    for i in range(turns):
        items.append({"role": "user", "content": f"What number comes after {i * 7}?"})
        items.append({"role": "assistant", "content": f"The number after {i * 7} is {i * 7 + 1}."})
    return [*items, {"role": "user", "content": "Name a colour."}]


def test_the_shorter_context_is_reported_and_held(served: Pipeline) -> None:
    root = served.http_url.removesuffix("/v1")
    got = httpx.post(f"{root}/tokenize", json={"prompt": "Hello"}, timeout=60)
    assert got.status_code == 200 and got.json()["max_model_len"] == CONTEXT
    (model,) = httpx.get(f"{served.http_url}/models", timeout=60).json()["data"]
    assert model["max_model_len"] == CONTEXT
    too_long = {"prompt": "one two three " * 120, "max_tokens": 4}  # ~360 tokens
    refused = httpx.post(f"{served.http_url}/completions", json=too_long, timeout=60)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert f"context of {CONTEXT}" in error["message"]
    assert error["code"] == "context_length_exceeded"  # what clients read to shorten and retry
    # Asking for more than the context leaves after the prompt is the same error.
    more = {"prompt": "one two three", "max_tokens": CONTEXT - 2}
    refused = httpx.post(f"{served.http_url}/completions", json=more, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    # Anthropic's API says it as Anthropic does.
    asked = {
        "model": "",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": too_long["prompt"]}],
    }
    refused = httpx.post(f"{served.http_url}/messages", json=asked, timeout=60)
    assert refused.status_code == 400
    said = refused.json()["error"]
    assert said["type"] == "invalid_request_error"
    assert said["message"].startswith("prompt is too long: ")


def test_truncation_auto_drops_the_oldest_turns_to_fit(sdk: openai.OpenAI) -> None:
    long = conversation(16)  # ~400 tokens: more than the context
    with pytest.raises(openai.BadRequestError, match=f"context of {CONTEXT}") as err:
        sdk.responses.create(input=long, instructions="Be brief.", **GREEDY)  # type: ignore[arg-type]
    assert err.value.code == "context_length_exceeded"
    counted = sdk.responses.input_tokens.count(
        input=long,  # type: ignore[arg-type]
        instructions="Be brief.",
        truncation="auto",
    )
    assert CONTEXT // 2 < counted.input_tokens < CONTEXT  # most of it kept, and a token to spare
    response = sdk.responses.create(
        input=long,  # type: ignore[arg-type]
        instructions="Be brief.",
        truncation="auto",
        **GREEDY,
    )
    assert response.status in ("completed", "incomplete") and response.truncation == "auto"
    assert response.output_text and response.usage is not None
    assert response.usage.input_tokens == counted.input_tokens
    # What was kept is the longest run of last turns that fits, and answers as it does alone.
    suffixes = [
        sdk.responses.input_tokens.count(input=long[2 * i :], instructions="Be brief.")  # type: ignore[arg-type]
        for i in range(17)
    ]
    longest = next(i for i, c in enumerate(suffixes) if c.input_tokens < CONTEXT)
    assert longest > 0 and counted.input_tokens == suffixes[longest].input_tokens
    alone = sdk.responses.create(input=long[2 * longest :], instructions="Be brief.", **GREEDY)  # type: ignore[arg-type]
    assert alone.output_text == response.output_text


def test_a_last_turn_longer_than_the_context_is_refused_by_name(sdk: openai.OpenAI) -> None:
    huge = [*conversation(2)[:-1], {"role": "user", "content": "one two three " * 120}]
    with pytest.raises(openai.BadRequestError, match="truncation auto cannot") as err:
        sdk.responses.create(input=huge, truncation="auto", **GREEDY)  # type: ignore[arg-type]
    assert err.value.body["param"] == "input"  # type: ignore[index]
    assert err.value.code == "context_length_exceeded"
