"""The async `TandemClient` against the fake server: assembly, errors, cancellation, deadlines."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from fake_server import TRACE_ID, FakeServer, Script, restart_serving, stream

from services.client import Delta, TandemClient, TandemError, Usage
from services.client_types import GenerationResult, InvalidOption, generate_request
from tandem.v1 import generation_pb2 as pb

PIECES = [("The", [504]), (" capital", [3575]), (" is Paris", [314, 7042]), (".", [30])]

# Long enough for a slow CI box, short next to the suite's own timeout.
WAIT = 10.0


def hang_after(pieces: list[tuple[str, list[int]]]) -> Script:
    return Script(stream(pieces, finish_reason=""), hang=True)


def test_the_stop_that_ended_each_sequence_is_read() -> None:
    result = GenerationResult(n=3)
    assert result.add(pb.GenerateResponse(request_id="r", prompt_token_ids=[1])) is None
    ends = [
        pb.GenerateResponse(text="a", token_ids=[5], finish_reason="stop", stop_string="b"),
        pb.GenerateResponse(index=1, token_ids=[7], finish_reason="stop", stop_token_id=7),
        pb.GenerateResponse(index=2, text="c", token_ids=[9], finish_reason="length"),
    ]
    deltas = [result.add(end) for end in ends]
    assert [d.stop_reason for d in deltas if d is not None] == ["b", 7, None]
    assert [c.stop_reason for c in result.choices] == ["b", 7, None]
    assert result.stop_reason == "b"


async def test_stream_assembles_what_was_sent(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: Script(stream(PIECES, prompt_ids=[1, 2, 3, 4]))
    async with TandemClient(fake.address) as client:
        generation = client.generate("The capital of France", max_tokens=5)
        deltas = [delta async for delta in generation]
    assert [d.text for d in deltas] == [text for text, _ in PIECES]
    assert [list(d.token_ids) for d in deltas] == [ids for _, ids in PIECES]
    assert [d.finish_reason for d in deltas] == [None, None, None, "stop"]
    assert deltas[-1].usage == Usage(prompt_tokens=4, completion_tokens=5)
    result = generation.result
    assert result.request_id == "req-1" and result.trace_id == TRACE_ID
    assert result.prompt_token_ids == [1, 2, 3, 4]
    assert result.token_ids == [504, 3575, 314, 7042, 30]
    assert result.text == "The capital is Paris."
    assert result.finish_reason == "stop"
    assert result.usage == Usage(prompt_tokens=4, completion_tokens=5)
    assert not fake.servicer.cancelled.is_set()  # the control for the cancellation tests


async def test_complete_returns_the_totals(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: Script(stream(PIECES, finish_reason="length"))
    async with TandemClient(fake.address) as client:
        result = await client.complete(prompt_ids=[1, 2, 3])
    assert result.text == "The capital is Paris." and result.finish_reason == "length"
    assert not fake.servicer.cancelled.is_set()


async def test_logprobs_arrive_per_token(fake: FakeServer) -> None:
    responses = stream([("a", [5])])
    token = responses[-1].logprobs.add(token_id=5, logprob=-0.25)
    token.top_logprobs.add(token_id=5, logprob=-0.25)
    token.top_logprobs.add(token_id=6, logprob=-1.5)
    fake.servicer.script = lambda _: Script(responses)
    async with TandemClient(fake.address) as client:
        result = await client.complete("x", logprobs=2)
    (only,) = result.logprobs
    assert (only.token_id, only.logprob, only.top) == (5, -0.25, ((5, -0.25), (6, -1.5)))


async def test_every_field_reaches_the_server(fake: FakeServer) -> None:
    traceparent = f"00-{TRACE_ID}-b7ad6b7169203331-01"
    async with TandemClient(fake.address) as client:
        await client.complete(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            temperature=0.5,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            seed=7,
            max_tokens=16,
            stop=["\n\n"],
            stop_token_ids=[2],
            ignore_eos=True,
            priority=3,
            session_id="conversation-1",
            logprobs=2,
            model="fake",
            request_id="mine",
            timeout=WAIT,
            metadata=[("traceparent", traceparent)],
        )
    (request,) = fake.servicer.requests
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]
    s = request.sampling
    assert (s.temperature, s.top_k, s.seed) == (0.5, 40, 7)
    assert s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.05)
    assert s.repetition_penalty == pytest.approx(1.1)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5)
    assert request.max_tokens == 16 and list(request.stop) == ["\n\n"]
    assert list(request.stop_token_ids) == [2] and request.ignore_eos
    assert (request.priority, request.session_id, request.logprobs) == (3, "conversation-1", 2)
    assert (request.model, request.request_id) == ("fake", "mine")
    assert fake.servicer.metadata[0]["traceparent"] == traceparent


async def test_unset_fields_stay_unset_so_the_server_defaults_apply(fake: FakeServer) -> None:
    async with TandemClient(fake.address) as client:
        await client.complete("hello", temperature=None, max_tokens=None)
    (request,) = fake.servicer.requests
    assert request.text == "hello"
    for name in ("temperature", "top_p", "top_k", "seed"):
        assert not request.sampling.HasField(name)
    assert not request.HasField("max_tokens")


def test_exactly_one_prompt_is_required() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        generate_request(None)
    with pytest.raises(ValueError, match="exactly one"):
        generate_request("text", prompt_ids=[1])


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"seed": -1}, "seed: Value out of range: -1"),
        ({"priority": 1 << 40}, "priority: Value out of range"),
        ({"top_k": "many"}, "top_k: "),
        ({"seed": 3, "temperature": 0.5, "n": 1 << 33}, "n: Value out of range: 8589934592"),
    ],
)
def test_an_option_no_request_can_carry_is_named_before_sending(
    options: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidOption) as err:
        generate_request("text", **options)
    assert str(err.value).startswith(named)


@pytest.mark.parametrize(
    ("code", "message"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be positive, got -1"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "12 requests are already waiting"),
        (grpc.StatusCode.UNAVAILABLE, "the scheduler is (re)starting; try again shortly"),
    ],
)
async def test_a_status_becomes_tandem_error(
    fake: FakeServer, code: grpc.StatusCode, message: str
) -> None:
    fake.servicer.script = lambda _: Script([], abort=(code, message))
    async with TandemClient(fake.address) as client:
        with pytest.raises(TandemError) as caught:
            await client.complete("hello")
    assert (caught.value.code, caught.value.message) == (code, message)
    assert str(caught.value) == f"{code.name}: {message}"


async def test_an_error_mid_stream_comes_after_the_deltas_sent(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: Script(
        stream(PIECES[:2], finish_reason=""), abort=(grpc.StatusCode.UNAVAILABLE, "worker died")
    )
    seen: list[Delta] = []
    async with TandemClient(fake.address) as client:
        generation = client.generate("hello")
        with pytest.raises(TandemError) as caught:
            async for delta in generation:
                seen.append(delta)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert caught.value.message == "worker died"
    assert [d.text for d in seen] == ["The", " capital"]
    assert generation.result.text == "The capital" and generation.result.finish_reason is None


async def test_a_stream_without_finish_reason_is_an_error(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: Script(stream(PIECES, finish_reason=""))
    async with TandemClient(fake.address) as client:
        with pytest.raises(TandemError, match="without a finish reason"):
            await client.complete("hello")


async def test_breaking_out_cancels_the_server_call(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: hang_after(PIECES[:1])
    async with TandemClient(fake.address) as client:
        async for _ in client.generate("hello"):
            break
        await asyncio.wait_for(fake.servicer.cancelled.wait(), WAIT)


async def test_breaking_out_cancels_even_while_the_generation_is_held(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: hang_after(PIECES[:1])
    async with TandemClient(fake.address) as client:
        generation = client.generate("hello")
        async for _ in generation:
            break
        await asyncio.wait_for(fake.servicer.cancelled.wait(), WAIT)
        assert [delta async for delta in generation] == []  # a cancelled generation is over
    assert generation.result.text == "The"


async def test_aclose_cancels_the_server_call(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: hang_after(PIECES[:1])
    async with TandemClient(fake.address) as client:
        generation = client.generate("hello")
        assert (await anext(generation)).text == "The"
        await generation.aclose()
        await asyncio.wait_for(fake.servicer.cancelled.wait(), WAIT)


async def test_leaving_async_with_cancels_the_server_call(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: hang_after(PIECES[:1])
    async with TandemClient(fake.address) as client:
        async with client.generate("hello") as generation:
            await anext(generation)
        await asyncio.wait_for(fake.servicer.cancelled.wait(), WAIT)


async def test_cancelling_the_task_cancels_the_server_call(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: hang_after(PIECES[:1])
    first = asyncio.Event()

    async def consume(client: TandemClient) -> None:
        async for _ in client.generate("hello"):
            first.set()

    async with TandemClient(fake.address) as client:
        task = asyncio.create_task(consume(client))
        await asyncio.wait_for(first.wait(), WAIT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(fake.servicer.cancelled.wait(), WAIT)


async def test_timeout_is_the_deadline(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: hang_after(PIECES[:1])
    async with TandemClient(fake.address) as client:
        with pytest.raises(TandemError) as caught:
            await client.complete("hello", timeout=0.3)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_tokenize_detokenize_list_models(fake: FakeServer) -> None:
    async with TandemClient(fake.address) as client:
        assert await client.tokenize("Hi") == [72, 105]
        assert await client.tokenize(messages=[{"role": "user", "content": "abc"}]) == [3]
        assert await client.detokenize([72, 105]) == "Hi"
        with pytest.raises(TandemError) as caught:
            await client.detokenize([72], model="x")
        (model,) = await client.list_models()
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message == "model: unknown model 'x'"
    assert (model.name, model.context_length, model.vocab_size) == ("fake", 2048, 49152)


async def test_wait_ready_returns_once_serving(fake: FakeServer) -> None:
    await fake.set_serving(False)
    async with TandemClient(fake.address) as client:
        waiting = asyncio.create_task(client.wait_ready(timeout=WAIT))
        done, _ = await asyncio.wait({waiting}, timeout=0.3)
        assert not done
        await fake.set_serving(True)
        await asyncio.wait_for(waiting, WAIT)


async def test_wait_ready_rides_out_a_restart(closed_address: str) -> None:
    """The server stops while the client waits (cutting its health watch) and comes back."""
    server = asyncio.create_task(restart_serving(closed_address))
    try:
        async with TandemClient(closed_address) as client:
            await client.wait_ready(timeout=WAIT)
    finally:
        await (await server).stop(grace=0)


async def test_wait_ready_times_out(fake: FakeServer, closed_address: str) -> None:
    await fake.set_serving(False)
    for address in (fake.address, closed_address):
        async with TandemClient(address) as client:
            with pytest.raises(TandemError) as caught:
                await client.wait_ready(timeout=0.3)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert caught.value.message == f"{address} was not ready within 0.3 s"


async def test_an_unreachable_server_is_unavailable(closed_address: str) -> None:
    async with TandemClient(closed_address) as client:
        with pytest.raises(TandemError) as caught:
            await client.complete("hello")
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


def test_request_of_token_ids() -> None:
    request = generate_request(None, prompt_ids=[5, 6], stop=["x"])
    assert request.WhichOneof("prompt") == "token_ids" and list(request.token_ids.ids) == [5, 6]
    assert isinstance(request, pb.GenerateRequest)


def test_chat_rendering_options_reach_the_request() -> None:
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "It is"}]
    request = generate_request(
        None, messages=messages, continue_final_message=True, chat_template_kwargs={"a": 1}
    )
    chat = request.chat
    assert chat.continue_final_message and not chat.HasField("add_generation_prompt")
    assert chat.chat_template_kwargs == '{"a": 1}'
    opened = generate_request(None, messages=messages, add_generation_prompt=False)
    assert opened.chat.HasField("add_generation_prompt") and not opened.chat.add_generation_prompt
    with pytest.raises(InvalidOption, match="continue_final_message: renders messages"):
        generate_request("text", continue_final_message=True)


def test_earlier_tool_calls_and_answers_reach_the_request() -> None:
    call = {"id": "a1B2c3D4e", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "a1B2c3D4e", "content": "sunny"},
    ]
    said = generate_request(None, messages=messages).chat.messages
    assert said[1].content == "" and json.loads(said[1].tool_calls) == [call]
    assert said[2].tool_call_id == "a1B2c3D4e" and not said[2].tool_calls
    assert not said[0].tool_calls and not said[0].tool_call_id
