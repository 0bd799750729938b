"""The OpenAI backend against a fake SSE server with scripted delays (in a thread)."""

from __future__ import annotations

from itertools import islice
from typing import Any

import pytest
from fake_openai import Reply, serve

from services.bench.config import BenchConfig, Target
from services.bench.metrics import summarize
from services.bench.report import table
from services.bench.runner import run
from services.bench.workload import requests

# First text after 0.3 s, then three chunks 0.2 s apart.
STEADY = Reply(steps=((0.3, "a"), (0.2, " b"), (0.2, " c"), (0.2, " d")), usage_tokens=4)


def config(url: str, **overrides: object) -> BenchConfig:
    args: dict[str, object] = {
        "targets": (Target("openai", url),),
        "num_requests": 3,
        "concurrency": 3,
        "progress": False,
        **overrides,
    }
    return BenchConfig(**args)  # type: ignore[arg-type]


async def test_ttft_itl_and_usage_from_the_stream() -> None:
    with serve(lambda _: STEADY) as fake:
        [result] = await run(config(fake.url))
    assert all(r.ok for r in result.records)
    for r in result.records:
        # Lower bounds set by the fake's own sleeps, never upper ones (this machine may be slow):
        # the first text 0.3 s after the request, the last 0.9 s after it.
        assert r.ttft is not None and r.ttft >= 0.3
        assert len(r.itls()) == 3 and min(r.itls()) > 0
        assert r.ttft + sum(r.itls()) >= 0.9
        assert (r.prompt_tokens, r.output_tokens, r.counted_tokens) == (7, 4, 4)
        assert r.cached_prompt_tokens == 3
        assert r.finish_reason == "length"
    [s] = summarize(result.records, result.window)
    assert (s.ok, s.failed) == (3, 0)
    assert s.output_throughput == pytest.approx(12 / s.duration_s)


async def test_completions_body_and_model_from_the_server() -> None:
    with serve(lambda _: STEADY) as fake:
        await run(config(fake.url, prompt_len=10, output_len=4, ignore_eos=True))
    assert fake.paths == ["/v1/completions"] * 3
    body = fake.bodies[0]
    assert body["model"] == "fake-model"
    assert len(body["prompt"].split()) == 10
    assert body["max_tokens"] == 4
    assert body["ignore_eos"] is True
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0


async def test_chat_endpoint_sends_messages_and_skips_the_role_chunk() -> None:
    with serve(lambda _: STEADY) as fake:
        [result] = await run(config(fake.url, endpoint="chat", dataset="chat", model="m"))
    assert fake.paths == ["/v1/chat/completions"] * 3
    assert fake.bodies[0]["model"] == "m"
    assert fake.bodies[0]["messages"][0]["role"] == "user"
    assert all(r.ok and r.counted_tokens == 4 and (r.ttft or 0) > 0.25 for r in result.records)


async def test_without_usage_the_chunks_are_counted() -> None:
    with serve(lambda _: Reply(steps=((0.0, "x"), (0.0, ""), (0.0, "y")))) as fake:
        [result] = await run(config(fake.url))
    assert all(r.ok and r.usage_tokens is None for r in result.records)
    # A chunk with no text carries no visible token.
    assert {r.output_tokens for r in result.records} == {2}


async def test_http_errors_and_broken_streams_are_counted_with_their_status() -> None:
    def reply(body: dict[str, Any]) -> Reply:
        words = len(body["prompt"].split())
        if words % 3 == 1:
            return Reply(status=503, error="Loading model")
        if words % 3 == 2:
            return Reply(steps=((0.0, "x"),), finish=False)
        return Reply(steps=((0.0, "x"),), usage_tokens=1)

    with serve(reply) as fake:
        cfg = config(fake.url, prompt_len=20, random_range=0.5, num_requests=30, concurrency=6)
        [result] = await run(cfg)
    specs = list(islice(requests(cfg), 30))
    expected = {0: None, 1: "HTTP 503", 2: "INCOMPLETE"}
    assert {r.index: r.status for r in result.records} == {
        s.index: expected[s.prompt_words % 3] for s in specs
    }
    assert len({r.status for r in result.records}) == 3
    text = table([result])
    assert "HTTP 503: Loading model" in text
    assert "INCOMPLETE: the stream ended without a finish reason" in text


async def test_an_unreachable_server_is_a_connect_error(closed_address: str) -> None:
    [result] = await run(config(f"http://{closed_address}", num_requests=2, model="m"))
    assert {r.status for r in result.records} == {"ConnectError"}
