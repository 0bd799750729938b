"""The OpenAI-compatible HTTP API end to end, with the real `openai` SDK (sync and async)
against a real `tandem serve`; and n, logit_bias and min_tokens through the gRPC API too."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.tokenizer import load_tokenizer
from harness.pipeline import Pipeline, pipeline
from services.client import Client
from services.client_types import TandemError
from tests.e2e.client import idle, scheduler_stats, stats_when

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The three primary colours are"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    with pipeline(tmp_path_factory.mktemp("openai"), "--max-num-seqs", "16") as running:
        yield running


@pytest.fixture(scope="module")
def sdk(served: Pipeline) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=served.http_url, api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(served: Pipeline) -> Iterator[Client]:
    with Client(served.address) as client:
        yield client


def test_models_lists_the_served_model(sdk: openai.OpenAI) -> None:
    (model,) = sdk.models.list().data
    assert model.id == "smollm2-135m-instruct" and model.owned_by == "tandem"
    assert sdk.models.retrieve("smollm2-135m-instruct") == model
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.models.retrieve("gpt-4o")
    assert missing.value.body["param"] == "model"  # type: ignore[index]


def test_greedy_chat_over_http_equals_grpc(sdk: openai.OpenAI, grpc_client: Client) -> None:
    reply = sdk.chat.completions.create(
        model="smollm2-135m-instruct", messages=CHAT, max_tokens=24, temperature=0
    )
    want = grpc_client.complete(messages=CHAT, max_tokens=24, temperature=0)
    (choice,) = reply.choices
    assert choice.message.content == want.text
    assert choice.message.role == "assistant" and choice.finish_reason == want.finish_reason
    assert reply.usage is not None and want.usage is not None
    assert reply.usage.completion_tokens == want.usage.completion_tokens
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streamed_completion_equals_the_whole_one(sdk: openai.OpenAI, grpc_client: Client) -> None:
    whole = sdk.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0)
    chunks = list(
        sdk.completions.create(
            model="",
            prompt=PROMPT,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert (
        text
        == whole.choices[0].text
        == grpc_client.complete(PROMPT, max_tokens=16, temperature=0).text
    )
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 3  # it streamed
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.completion_tokens == 16 and usage.total_tokens == usage.prompt_tokens + 16
    assert whole.choices[0].finish_reason == "length"


def test_async_chat_stream_with_two_choices(served: Pipeline) -> None:
    async def scenario() -> dict[int, list[str]]:
        async with openai.AsyncOpenAI(base_url=served.http_url, api_key="x", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model="smollm2-135m-instruct",
                messages=CHAT,
                max_tokens=12,
                temperature=1.0,
                seed=3,
                n=2,
                stream=True,
            )
            texts: dict[int, list[str]] = {}
            finished = set()
            async for chunk in stream:
                for choice in chunk.choices:
                    texts.setdefault(choice.index, []).append(choice.delta.content or "")
                    if choice.finish_reason:
                        finished.add(choice.index)
            assert finished == {0, 1}
            return texts

    texts = asyncio.run(scenario())
    assert set(texts) == {0, 1}
    assert all("".join(t) for t in texts.values())


def test_n_sequences_share_the_prompts_blocks(grpc_client: Client) -> None:
    long_prompt = "Here is a list of animals: " + ", ".join(["cat", "dog", "owl"] * 20) + "."
    result = grpc_client.complete(
        long_prompt, max_tokens=4, temperature=0.8, seed=5, n=3, ignore_eos=True
    )
    assert len(result.choices) == 3
    assert all(c.finish_reason == "length" and len(c.token_ids) == 4 for c in result.choices)
    prompt = len(result.prompt_token_ids)
    cached = [c.usage.cached_prompt_tokens for c in result.choices if c.usage is not None]
    # The later sequences find every full block of the prompt computed by the first.
    assert cached[1] >= prompt - 16 and cached[2] >= prompt - 16


def test_logprobs_in_chat_and_completions(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model="", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == reply.usage.completion_tokens  # type: ignore[union-attr]
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy
    completion = sdk.completions.create(
        model="", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert "".join(lp.tokens) == completion.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs or [])


def test_tokens_named_by_their_ids_are_the_tokens_generated(
    sdk: openai.OpenAI, grpc_client: Client
) -> None:
    """vLLM's return_tokens_as_token_ids: each token in logprobs is "token_id:<id>", the ids
    those whose text is the reply's; the offsets stay the text's."""
    asked: dict[str, Any] = dict(model="", max_tokens=6, temperature=0)
    named = {"return_tokens_as_token_ids": True}
    completion = sdk.completions.create(**asked, prompt=PROMPT, logprobs=2, extra_body=named)
    lp = completion.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert [f"token_id:{i}" for i in ids] == lp.tokens
    assert grpc_client.detokenize(ids) == completion.choices[0].text
    texts = [grpc_client.detokenize([i]) for i in ids]
    assert lp.text_offset == [sum(map(len, texts[:k])) for k in range(len(texts))]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in lp.top_logprobs or [] for k in top)
    reply = sdk.chat.completions.create(
        **asked, messages=CHAT, logprobs=True, top_logprobs=2, extra_body=named
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    chat_ids = [int(t.token.removeprefix("token_id:")) for t in content]
    assert grpc_client.detokenize(chat_ids) == reply.choices[0].message.content
    assert (
        bytes(b for t in content for b in t.bytes or []).decode()
        == reply.choices[0].message.content
    )


def test_only_allowed_tokens_are_generated(sdk: openai.OpenAI, grpc_client: Client) -> None:
    """vLLM's allowed_token_ids: every token generated is one of them (an end of sequence only
    where listed), sampled or greedy; with an output format it is refused by name."""
    allowed = sorted({*grpc_client.tokenize(" red green blue"), *grpc_client.tokenize(",")})
    for temperature in (0, 1):
        completion = sdk.completions.create(
            model="", prompt=PROMPT, max_tokens=8, temperature=temperature, seed=3, logprobs=0,
            extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True},
        )  # fmt: skip
        lp = completion.choices[0].logprobs
        assert lp is not None and lp.tokens is not None
        assert {int(t.removeprefix("token_id:")) for t in lp.tokens} <= set(allowed)
        assert completion.choices[0].finish_reason == "length"  # no end of sequence listed
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(
            model="", messages=CHAT, max_tokens=4, response_format={"type": "json_object"},
            extra_body={"allowed_token_ids": allowed},
        )  # fmt: skip
    assert refused.value.body["param"] == "allowed_token_ids"  # type: ignore[index]


def test_bad_words_are_not_written(sdk: openai.OpenAI, grpc_client: Client) -> None:
    """vLLM's bad_words: a word the greedy reply writes is, asked against, not written as its
    tokens (at the start or after a space); past the limits, refused by name."""
    asked: dict[str, Any] = dict(model="", prompt=PROMPT, max_tokens=12, temperature=0)
    named = {"return_tokens_as_token_ids": True}
    free = sdk.completions.create(**asked, logprobs=0, extra_body=named)
    words = free.choices[0].text.split()
    assert len(words) >= 2, free.choices[0].text
    word = words[1].strip(".,;:")
    held = sdk.completions.create(**asked, logprobs=0, extra_body={**named, "bad_words": [word]})
    lp = held.choices[0].logprobs
    assert lp is not None and lp.tokens is not None
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    free_lp = free.choices[0].logprobs
    assert free_lp is not None and free_lp.tokens is not None
    free_ids = [int(t.removeprefix("token_id:")) for t in free_lp.tokens]
    forms = [grpc_client.tokenize(form) for form in (word, f" {word}")]

    def written(ids: list[int], word_ids: list[int]) -> bool:
        return word_ids in [ids[i : i + len(word_ids)] for i in range(len(ids))]

    assert any(written(free_ids, w) for w in forms)  # so the ban has something to hold back
    assert not any(written(ids, w) for w in forms), held.choices[0].text
    for bad, says in (
        (["w"] * 33, "at most 32 words"),
        ([" "], "a word is empty"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.completions.create(**asked, extra_body={"bad_words": bad})
        assert refused.value.body["param"] == "bad_words"  # type: ignore[index]
        assert says in refused.value.body["message"]  # type: ignore[index]


def test_openais_fields_tandem_needs_none_of_are_taken(sdk: openai.OpenAI) -> None:
    """service_tier, prompt_cache_key and safety_identifier, as agents' SDKs send them."""
    asked: dict[str, Any] = dict(model="", messages=CHAT, max_tokens=6, temperature=0)
    taken = sdk.chat.completions.create(
        **asked, service_tier="auto", prompt_cache_key="conversation-7", safety_identifier="u1"
    )
    assert taken.choices[0].message.content and taken.usage is not None
    assert taken.usage.completion_tokens == 6


def test_a_truncated_prompt_is_its_last_tokens(sdk: openai.OpenAI, grpc_client: Client) -> None:
    """vLLM's truncate_prompt_tokens: the completion is that of the prompt's last tokens, and
    counts them; without it a prompt too long for the context is refused naming the way out."""
    ids = grpc_client.tokenize(PROMPT)
    asked: dict[str, Any] = dict(model="", max_tokens=5, temperature=0)
    cut = sdk.completions.create(**asked, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 3})
    of_ids = sdk.completions.create(**asked, prompt=ids[-3:])
    assert cut.choices[0].text == of_ids.choices[0].text
    assert cut.usage is not None and cut.usage.prompt_tokens == 3
    echoed = sdk.completions.create(
        **{**asked, "max_tokens": 1},
        prompt=PROMPT,
        echo=True,
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert echoed.choices[0].text.startswith(grpc_client.detokenize(ids[-3:]))  # what was run
    chat = sdk.chat.completions.create(
        **asked, messages=CHAT, extra_body={"truncate_prompt_tokens": 4}
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 4
    too_long = "colour " * 9000
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(**asked, prompt=too_long)
    assert "truncate_prompt_tokens" in refused.value.body["message"]  # type: ignore[index]
    fitted = sdk.completions.create(
        **{**asked, "max_tokens": 1}, prompt=too_long, extra_body={"truncate_prompt_tokens": -1}
    )
    assert fitted.usage is not None and fitted.usage.completion_tokens == 1
    with pytest.raises(openai.BadRequestError) as beyond:
        sdk.completions.create(**asked, prompt=PROMPT, extra_body={"truncate_prompt_tokens": 10**6})
    assert beyond.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


def test_echo_scores_the_prompt_as_evaluation_harnesses_ask(
    sdk: openai.OpenAI, default_gguf: Path
) -> None:
    """lm-evaluation-harness's loglikelihood request: the context and continuation as token
    ids, echo, logprobs 1, max_tokens 1; it reads the continuation's prompt logprobs."""
    tokenizer = load_tokenizer(default_gguf)
    context = tokenizer.encode_prompt("The capital of France is", allow_special=False)
    continuation = tokenizer.encode(" Paris", allow_special=False)
    ids = context + continuation
    scored = sdk.completions.create(
        model="", prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lp = scored.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(ids) + 1  # the prompt, then the one token generated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert scored.choices[0].text.startswith(tokenizer.decode(ids))
    # The continuation's first token was scored from the context: the same distribution a
    # completion of the context samples its first token from.
    after_context = sdk.completions.create(
        model="", prompt=context, max_tokens=1, temperature=0, logprobs=5
    )
    sampled = after_context.choices[0].logprobs
    assert sampled is not None and sampled.top_logprobs is not None
    alternatives = sampled.top_logprobs[0]
    (best, best_lp), (echoed_best, echoed_lp) = (
        max(alternatives.items(), key=lambda kv: kv[1]),
        next(iter(lp.top_logprobs[len(context)].items())),
    )
    assert echoed_best == best and echoed_lp == pytest.approx(best_lp, abs=1e-3)
    paris = tokenizer.token_bytes(continuation[0]).decode()
    if paris in alternatives:
        assert lp.token_logprobs[len(context)] == pytest.approx(alternatives[paris], abs=1e-3)
    # max_tokens 0: the prompt alone. And vLLM's prompt_logprobs, in its form.
    alone = sdk.completions.create(
        model="",
        prompt=ids,
        echo=True,
        logprobs=0,
        max_tokens=0,
        extra_body={"prompt_logprobs": 2},
    )
    choice = alone.choices[0]
    assert choice.text == tokenizer.decode(ids) and alone.usage is not None
    assert alone.usage.completion_tokens == 0
    assert choice.logprobs is not None and choice.logprobs.token_logprobs == lp.token_logprobs[:-1]
    vllm = choice.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert vllm[0] is None and len(vllm) == len(ids)
    for position, entry in enumerate(vllm[1:], start=1):
        own = entry[str(ids[position])]
        assert own["logprob"] == lp.token_logprobs[position] and own["rank"] >= 1
        # The best two by rank; the token itself among them where it is one of them.
        assert {1, 2} <= {v["rank"] for v in entry.values()} and len(entry) == 2 + (own["rank"] > 2)
    chat_scored = sdk.chat.completions.create(
        model="", messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    assert len(chat_scored.model_extra["prompt_logprobs"]) == chat_scored.usage.prompt_tokens  # type: ignore[index,union-attr]
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(model="", prompt="x", max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_stop_strings_end_the_text(sdk: openai.OpenAI, grpc_client: Client) -> None:
    prompt = "Count from 1 to 50: 1, 2, 3,"
    full = sdk.completions.create(model="", prompt=prompt, max_tokens=40, temperature=0)
    text = full.choices[0].text
    assert " 9," in text, text
    assert " 7," in text and text.index(" 7,") < text.index(" 9,")
    asked: dict[str, Any] = dict(model="", prompt=prompt, max_tokens=40, temperature=0)
    # The first to begin ends it, and is named (vLLM's stop_reason), whichever is listed first.
    stopped = sdk.completions.create(**asked, stop=[" 9,", " 7,"])
    assert stopped.choices[0].text == text[: text.index(" 7,")]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == " 7,"  # type: ignore[index]
    kept = sdk.completions.create(
        **asked, stop=[" 9,", " 7,"], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == text[: text.index(" 7,") + 3]  # vLLM's option
    chunks = list(sdk.completions.create(**asked, stop=[" 9,", " 7,"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == stopped.choices[0].text
    assert chunks[-1].choices[0].model_extra["stop_reason"] == " 7,"  # type: ignore[index]
    # A stop token id of the request's is named too; the model's own end, or a length, is not.
    (comma,) = grpc_client.tokenize(",")
    by_id = sdk.completions.create(**asked, extra_body={"stop_token_ids": [comma]})
    assert by_id.choices[0].text == text[: text.index(",")]
    assert by_id.choices[0].model_extra["stop_reason"] == comma  # type: ignore[index]
    assert full.choices[0].model_extra["stop_reason"] is None  # type: ignore[index]


def test_errors_surface_as_the_sdks_exceptions(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model="", messages=CHAT, temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in bad.value.message
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4o", messages=CHAT)
    for name, value, param in (
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x"}},
            "response_format.json_schema",  # no schema in it
        ),
        ("best_of", 3, "best_of"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model="", messages=CHAT, extra_body={name: value})
        assert refused.value.body["param"] == param  # type: ignore[index]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\]"):
        sdk.chat.completions.create(model="", messages=image)  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        sdk.completions.create(model="", prompt=PROMPT, max_tokens=10**6)


def test_a_path_or_method_not_served_is_named_with_what_is(served: Pipeline) -> None:
    """An endpoint tandem does not serve (embeddings) is a 404 naming the URL and the served
    routes, not an unknown model's code; a wrong method is a 405 naming the right one."""
    with httpx.Client(base_url=served.http_url, timeout=60) as http:
        missing = http.post("/embeddings", json={"input": "hi"})
        error = missing.json()["error"]
        assert missing.status_code == 404 and error["code"] is None
        assert error["message"].startswith("Invalid URL (POST /v1/embeddings): this server serves")
        assert "POST /v1/chat/completions" in error["message"]
        assert "GET /v1/models" in error["message"]
        wrong = http.get("/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"] == {
            "message": "GET /v1/chat/completions is not allowed: use POST",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        anthropic = http.get("/messages").json()  # in Anthropic's shape on its route
        assert anthropic["error"]["type"] == "invalid_request_error"


def test_request_id_is_taken_and_echoed(served: Pipeline) -> None:
    body = {"messages": CHAT, "max_tokens": 2}
    with httpx.Client(base_url=served.http_url, timeout=60) as http:
        reply = http.post("/chat/completions", json=body, headers={"X-Request-Id": "req-42"})
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "req-42"
        assert reply.json()["id"] == "chatcmpl-req-42"
        made = http.post("/chat/completions", json=body)
        assert len(made.headers["x-request-id"]) == 32
        root = served.http_url.removesuffix("/v1")
        assert http.get(f"{root}/health").json() == {"status": "ok"}
        assert "tandem_request_success_total" in http.get(f"{root}/metrics").text


def test_tokenize_gives_the_ids_a_request_runs_and_detokenize_the_text(
    served: Pipeline, sdk: openai.OpenAI, grpc_client: Client
) -> None:
    """vLLM's /tokenize and /detokenize: the ids equal the gRPC API's and count as the prompt
    tokens of a completion (or, through the template, a chat completion) of the same prompt."""
    root = served.http_url.removesuffix("/v1")
    with httpx.Client(base_url=root, timeout=60) as http:
        text = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
        chat = http.post("/tokenize", json={"messages": CHAT, "model": ""}).json()
        back = http.post("/detokenize", json={"tokens": text["tokens"]}).json()
        unknown = http.post("/detokenize", json={"tokens": [10**6]})
        (model,) = http.get("/v1/models").json()["data"]
    assert text["tokens"] == grpc_client.tokenize(PROMPT) and text["count"] == len(text["tokens"])
    completion = sdk.completions.create(model="", prompt=PROMPT, max_tokens=1)
    assert completion.usage is not None and completion.usage.prompt_tokens == text["count"]
    assert "".join(text["token_strs"]).endswith(PROMPT) and back["prompt"].endswith(PROMPT)
    assert chat["tokens"] == grpc_client.tokenize(messages=CHAT)
    reply = sdk.chat.completions.create(model="", messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert reply.usage is not None and reply.usage.prompt_tokens == chat["count"]
    assert chat["token_strs"] is None and chat["max_model_len"] == model["max_model_len"]
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tokens"


def test_a_body_over_the_limit_is_refused_and_the_server_serves_on(
    served: Pipeline, sdk: openai.OpenAI
) -> None:
    """The same 64 MiB as a gRPC message: past it, 413 before the body is read whole."""
    prompt = "x" * (64 << 20)
    with httpx.Client(base_url=served.http_url, timeout=120) as http:
        refused = http.post("/completions", json={"prompt": prompt, "max_tokens": 1})
    assert refused.status_code == 413
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].endswith("bytes; this server takes at most 67108864")
    reply = sdk.completions.create(model="", prompt=PROMPT, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    # Refused before it became a Generate call, and still on the operator's dashboard.
    scraped = httpx.get(served.metrics["tokenizer-1"], timeout=30).text
    counts = {
        (s.labels["route"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(scraped)
        if family.name == "tandem_http_requests"
        for s in family.samples
        if s.name.endswith("_total") and s.labels["method"] == "POST"
    }
    assert counts[("/v1/completions", "413")] >= 1 and counts[("/v1/completions", "200")] >= 1


def test_closing_a_stream_cancels_the_request_and_frees_its_kv(served: Pipeline) -> None:
    async def scenario():  # type: ignore[no-untyped-def]
        before = await stats_when(served.scheduler_address, idle, "an idle pipeline")
        async with openai.AsyncOpenAI(base_url=served.http_url, api_key="x", max_retries=0) as c:
            stream = await c.completions.create(
                model="",
                prompt="Tell a long story:",
                max_tokens=4000,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            seen = 0
            async for chunk in stream:
                seen += bool(chunk.choices and chunk.choices[0].text)
                if seen >= 3:
                    break
            during = await scheduler_stats(served.scheduler_address)
            await stream.close()
        after = await stats_when(served.scheduler_address, idle, "the closed stream's request")
        return before, during, after

    before, during, after = asyncio.run(scenario())
    assert during.running == 1 and during.kv_blocks_used > 0
    assert after.finished["cancelled"] == before.finished["cancelled"] + 1
    assert after.finished.get("length", 0) == before.finished.get("length", 0)
    assert after.kv_blocks_used == 0


def test_a_client_that_leaves_a_whole_response_cancels_it(served: Pipeline) -> None:
    async def scenario():  # type: ignore[no-untyped-def]
        before = await stats_when(served.scheduler_address, idle, "an idle pipeline")
        body = {"prompt": "Tell a long story:", "max_tokens": 4000, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=served.http_url, timeout=60) as http:
            post = asyncio.create_task(http.post("/completions", json=body))
            await stats_when(served.scheduler_address, lambda s: s.running == 1, "it to run")
            post.cancel()  # closes the connection
        after = await stats_when(served.scheduler_address, idle, "the abandoned request")
        return before, after

    before, after = asyncio.run(scenario())
    assert after.finished["cancelled"] == before.finished["cancelled"] + 1
    assert after.kv_blocks_used == 0


def test_min_tokens_and_logit_bias_through_grpc(grpc_client: Client) -> None:
    plain = grpc_client.complete(messages=CHAT, max_tokens=200, temperature=0)
    assert plain.finish_reason == "stop"
    longer = grpc_client.complete(
        messages=CHAT, max_tokens=200, temperature=0, min_tokens=len(plain.token_ids) + 5
    )
    assert len(longer.token_ids) >= len(plain.token_ids) + 5
    assert longer.text.startswith(plain.text)
    first = plain.token_ids[0]
    banned = grpc_client.complete(
        messages=CHAT, max_tokens=3, temperature=0, logit_bias={first: -100.0}
    )
    assert banned.token_ids[0] != first


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_chat_held_to_a_json_schema_streams_objects_it_accepts(served: Pipeline) -> None:
    async def scenario() -> list[str]:
        async with openai.AsyncOpenAI(base_url=served.http_url, api_key="-") as sdk:
            stream = await sdk.chat.completions.create(
                model="",
                messages=[{"role": "user", "content": "Describe a person called Ann."}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
                },
                n=3,
                temperature=1.0,
                seed=5,
                max_tokens=60,
                stream=True,
            )
            texts = ["", "", ""]
            reasons = [None, None, None]
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
                    reasons[choice.index] = choice.finish_reason or reasons[choice.index]
            assert reasons == ["stop"] * 3
            return texts

    for text in asyncio.run(scenario()):
        person = json.loads(text)
        assert set(person) == {"name", "age"} and isinstance(person["age"], int)
        assert isinstance(person["name"], str) and len(person["name"]) <= 24


def test_json_object_regex_and_choice_hold_the_output(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model="", messages=CHAT, response_format={"type": "json_object"}, max_tokens=48,
        temperature=0,
    )  # fmt: skip
    (choice,) = reply.choices
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # cut by max_tokens: still the start of an object
        assert (choice.message.content or "").startswith("{")
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    done = sdk.completions.create(
        model="", prompt="The first moon landing was on", max_tokens=16, temperature=0,
        extra_body={"structured_outputs": {"regex": date}},
    )  # fmt: skip
    assert re.fullmatch(date, done.choices[0].text) and done.choices[0].finish_reason == "stop"
    picked = sdk.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, temperature=0,
    )  # fmt: skip
    assert picked.choices[0].message.content in ("yes", "no")
    grammar = 'root ::= "The sky is " colour "."\ncolour ::= "blue" | "green"'  # GBNF
    said = sdk.chat.completions.create(
        model="", messages=[{"role": "user", "content": "What colour is the sky?"}],
        max_tokens=16, extra_body={"structured_outputs": {"grammar": grammar}}, temperature=0,
    )  # fmt: skip
    assert said.choices[0].message.content in ("The sky is blue.", "The sky is green.")
    # vLLM's older names of the same forms (guided_*), as code written for them sends them.
    for older, newer in (
        ({"guided_regex": date}, {"regex": date}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_json": {"type": "integer"}}, {"json": {"type": "integer"}}),
    ):
        asked: dict[str, Any] = dict(model="", messages=CHAT, max_tokens=12, temperature=0)
        got = sdk.chat.completions.create(
            **asked, extra_body={**older, "guided_decoding_backend": "x"}
        )
        want = sdk.chat.completions.create(**asked, extra_body={"structured_outputs": newer})
        assert got.choices[0].message.content == want.choices[0].message.content


def test_a_bad_output_format_is_refused_and_nothing_is_held(
    sdk: openai.OpenAI, served: Pipeline
) -> None:
    colour = {"name": "x", "schema": {"type": "colour"}}
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": colour}}, "schema"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "regex"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"ignore_eos": True}}, ""),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= ((("}}}, "neither"),
        ({"extra_body": {"structured_outputs": {"json": {"type": "colour"}}}}, "colour"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "regex"),
        ({"extra_body": {"guided_json": {"type": "colour"}}}, "colour"),
        ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "one form"),
    ]
    params = [
        "response_format.json_schema.schema",
        "structured_outputs.regex",
        "ignore_eos",
        "structured_outputs.grammar",
        "structured_outputs.json",
        "guided_regex",
        "guided_json",
        "guided_choice",
    ]
    for (extra, words), param in zip(bad, params, strict=True):
        with pytest.raises(openai.BadRequestError) as err:
            sdk.chat.completions.create(model="", messages=CHAT, max_tokens=4, **extra)
        assert err.value.body["param"] == param, err.value.body  # type: ignore[index]
        assert words in err.value.message
    after = asyncio.run(stats_when(served.scheduler_address, idle, "the refused requests"))
    assert after.kv_blocks_used == 0


def test_grpc_output_format_and_its_errors(grpc_client: Client) -> None:
    out = grpc_client.complete(
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        output_format={"choice": {"choices": ["red", "green", "blue"]}},
    )
    assert out.text in ("red", "green", "blue") and out.finish_reason == "stop"
    with pytest.raises(TandemError) as err:
        grpc_client.complete(
            messages=CHAT, max_tokens=4, output_format={"json_schema": "{"}, min_tokens=0
        )
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message.startswith("output_format.json_schema: is not JSON")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_named_function_and_required_tools_answer_with_tool_calls(sdk: openai.OpenAI) -> None:
    named = sdk.chat.completions.create(
        model="",
        messages=ASK,
        tools=[TIME, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=40,
    )
    (choice,) = named.choices
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = sdk.chat.completions.create(
        model="", messages=ASK, tools=[TIME, WEATHER], tool_choice="required", max_tokens=80,
        temperature=0,
    )  # fmt: skip
    (choice,) = required.choices
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (TIME, WEATHER)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_tool_calls_stream_whole_and_a_tool_result_is_a_turn(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model="", messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    chunks = list(stream)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    (call,) = calls
    assert call.index == 0 and call.function is not None and call.function.name == "get_weather"
    arguments = call.function.arguments or ""
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "stop"
    said = {
        "id": call.id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    follow_up = sdk.chat.completions.create(
        model="",
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [said]},
            {"role": "tool", "tool_call_id": call.id or "", "content": "Sunny, 21 degrees."},
        ],
        max_tokens=24,
        temperature=0,
    )
    assert follow_up.choices[0].message.content and not follow_up.choices[0].message.tool_calls


def test_tool_choice_auto_answers_in_text_or_with_calls(
    sdk: openai.OpenAI, default_gguf: Path
) -> None:
    """OpenAI's default. Pushed to begin with "{" (logit_bias), the reply is calls, held to
    the tools' schemas, streamed whole; asked to greet, the default model answers in text."""
    (brace,) = load_tokenizer(default_gguf).encode("{", allow_special=False)
    asked = dict(model="", messages=ASK, tools=[TIME], temperature=0, max_tokens=60)
    called = sdk.chat.completions.create(**asked, logit_bias={str(brace): 100})  # type: ignore[call-overload]
    (choice,) = called.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    chunks = list(
        sdk.chat.completions.create(**asked, logit_bias={str(brace): 100}, stream=True)  # type: ignore[call-overload]
    )
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    (streamed,) = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert streamed.function is not None
    assert streamed.function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    greeting = [{"role": "user", "content": "Hello! Who are you?"}]
    chunks = list(
        sdk.chat.completions.create(**{**asked, "messages": greeting}, stream=True)  # type: ignore[call-overload]
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # as it came
    assert (
        text and text[0] not in "{[" and chunks[-1].choices[0].finish_reason in ("stop", "length")
    )
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)


def test_tool_errors_name_their_parameter(sdk: openai.OpenAI) -> None:
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "colour"}}}
    function_f = {"name": "f"}
    cases = [
        ({"tools": [WEATHER, bad_schema]}, "tools"),  # "auto", OpenAI's default
        ({"tools": [WEATHER, bad_schema], "tool_choice": "required"}, "tools"),
        (
            {
                "tools": [WEATHER, bad_schema],
                "tool_choice": {"type": "function", "function": function_f},
            },
            "tools[1].function.parameters",
        ),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            sdk.chat.completions.create(model="", messages=ASK, max_tokens=4, **extra)
        assert err.value.body["param"] == param, err.value.body  # type: ignore[index]


def test_without_a_key_the_server_says_it_is_open(served: Pipeline) -> None:
    assert "the API is open to anyone who can reach 127.0.0.1" in served.log()
