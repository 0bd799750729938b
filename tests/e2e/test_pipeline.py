"""The three-process pipeline end to end, in the default arithmetic: real processes on loopback,
the real default model (int8 activations on CPU), compared with the engine in this process.

Where a stream runs alone its arithmetic is the engine's alone, and the tokens are equal. Where
streams share steps, the batch changes roundings in the int8 activations, so the claim is what
holds of that arithmetic: every token the pipeline picked is within a small margin of the best
one, judged by the engine alone on the same history (tests/e2e/test_exact.py makes the equality
claim for batched streams, in fp32).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.pipeline import Pipeline, pipeline, shm_names_of
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.e2e.client import Reference, Streamed, greedy, idle, scheduler_stats, stats_when, stream

pytestmark = pytest.mark.slow

# A token the pipeline picks may trail the best one by at most this many nats when other
# sequences shared its steps: far above what batching changes in the int8 activations, far
# below what a token from another sequence's KV, or a wrong position, would cost.
BATCHING_MARGIN = 0.5


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    with pipeline(tmp_path_factory.mktemp("pipe"), "--max-num-seqs", "32") as running:
        yield running
    pids = [p for ps in running.child_pids().values() for p in ps]
    assert pids and not shm_names_of(pids), "shared memory left behind after shutdown"


@pytest.fixture(scope="module")
def reference(default_gguf: Path) -> Reference:
    return Reference(default_gguf)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_streamed_greedy_output_equals_tandem_run(served: Pipeline, reference: Reference) -> None:
    for request in (
        greedy(text="The three primary colours are"),
        greedy(chat="Name a famous bridge in San Francisco."),
    ):
        got = run(stream(served.address, request))
        want = reference.generate(got.prompt_ids, request.max_tokens)
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert got.usage is not None and got.usage.completion_tokens == len(want.token_ids)
        assert got.messages >= 3  # first (ids), at least one delta, the last: it streamed


def test_32_concurrent_streams_stay_near_greedy(served: Pipeline, reference: Reference) -> None:
    prompts = [
        "Tell me about the moon.",
        "What is 2+2?",
        "Write a short poem about rain.",
        "List three fruits.",
    ]

    async def run_all() -> list[Streamed]:
        return await asyncio.gather(
            *(stream(served.address, greedy(chat=prompts[i % 4], max_tokens=16)) for i in range(32))
        )

    results = run(run_all())
    picks = agree = 0
    judged: dict[tuple[int, ...], list[float]] = {}
    for i, got in enumerate(results):
        assert got.finish_reason in ("stop", "length"), f"stream {i}"
        assert got.usage is not None and got.usage.completion_tokens == len(got.token_ids)
        key = (*got.prompt_ids, -1, *got.token_ids)
        if key not in judged:
            tops = reference.forced(got.prompt_ids, got.token_ids)
            judged[key] = [gap(top, token) for top, token in zip(tops, got.token_ids, strict=True)]
        gaps = judged[key]
        assert max(gaps) <= BATCHING_MARGIN, f"stream {i} (prompt {i % 4}): gaps {gaps}"
        picks += len(gaps)
        agree += sum(g == 0 for g in gaps)
    assert agree >= 0.9 * picks  # nearly every pick is the engine's own best


def gap(top: list[tuple[int, float]], token: int) -> float:
    """How far `token`'s logprob trails the best, from the reference's top list."""
    for token_id, logprob in top:
        if token_id == token:
            return top[0][1] - logprob
    return float("inf")


@pytest.mark.parametrize(
    ("request_fields", "field_name"),
    [
        (dict(text=""), "prompt"),
        (dict(text="x" * 600_000), "prompt.text"),  # an oversized message
        (dict(text="hi", max_tokens=0), "max_tokens"),
        (dict(text="hi", max_tokens=9000), "max_tokens"),
        (dict(text="hi", sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature"),
        (dict(text="hi", sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
        (dict(text="hi", sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
        (dict(text="hi", sampling=pb.SamplingParams(top_k=-1)), "sampling.top_k"),
        (dict(text="hi", model="no-such-model"), "model"),
        (dict(token_ids=pb.TokenIds(ids=[1, -5])), "prompt.token_ids"),
        (dict(token_ids=pb.TokenIds(ids=[1, 49152])), "prompt.token_ids"),
        (dict(text="word " * 9000), "prompt"),  # tokenizes past the context
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(
    served: Pipeline,
    request_fields: dict,  # type: ignore[type-arg]
    field_name: str,
) -> None:
    with pytest.raises(aio.AioRpcError) as err:
        run(stream(served.address, pb.GenerateRequest(**request_fields)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(field_name)
    still = run(stream(served.address, greedy(text="Still serving?", max_tokens=2)))
    assert len(still.token_ids) == 2


# Bytes no protobuf library would send: a client crafting them by hand gets a status that says
# what was wrong, never UNKNOWN (grpc's answer when a request fails to parse) or a traceback.
_NOT_UTF8 = b"\x0a\x03\xff\xfeA"  # field 1 (a string) holding bytes that are not UTF-8
_CORRUPT = b"\xff\xff\xff"  # not a message at all


@pytest.mark.parametrize(
    ("method", "data"),
    [
        ("/tandem.v1.Generation/Generate", _NOT_UTF8),
        ("/tandem.v1.Generation/Generate", _CORRUPT),
        ("/tandem.v1.Generation/Generate", b"\x12\x06\x0a\x04\x12\x02\xc0\x80"),  # chat
        ("/tandem.v1.Generation/Tokenize", _NOT_UTF8),
        ("/tandem.v1.Generation/Detokenize", b"\x1a\x01\xff"),  # model
        ("/tandem.v1.Generation/ListModels", _CORRUPT),
        ("/grpc.health.v1.Health/Check", _NOT_UTF8),
    ],
)
def test_a_request_that_does_not_parse_is_invalid_argument(
    served: Pipeline, method: str, data: bytes
) -> None:
    async def call() -> aio.AioRpcError:
        async with aio.insecure_channel(served.address) as channel:
            if method.endswith("/Generate"):
                rpc = channel.unary_stream(method, lambda b: b, lambda b: b)
                request = rpc(data, timeout=30)
                with pytest.raises(aio.AioRpcError) as err:
                    async for _ in request:
                        pass
            else:
                with pytest.raises(aio.AioRpcError) as err:
                    await channel.unary_unary(method, lambda b: b, lambda b: b)(data, timeout=30)
            return err.value

    err = run(call())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert (err.details() or "").startswith("request: Error parsing message"), err.details()
    assert "DecodeError" not in served.log()


def test_health_of_an_unknown_service_is_not_found_naming_it(served: Pipeline) -> None:
    async def check(service: str) -> health_pb2.HealthCheckResponse:
        async with aio.insecure_channel(served.address) as channel:
            return await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=30
            )

    assert run(check("tandem.v1.Generation")).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(aio.AioRpcError) as err:
        run(check("no.such.Service"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'no.such.Service'" in (err.value.details() or "")


def test_the_scheduler_drops_a_request_at_its_deadline(served: Pipeline) -> None:
    async def scenario() -> tuple[aio.AioRpcError, dict[str, int], dict[str, int], object]:
        before = await stats_when(served.scheduler_address, idle, "an idle pipeline")
        request = greedy(text="Count forever:", max_tokens=4000, ignore_eos=True)
        with pytest.raises(aio.AioRpcError) as err:
            await stream(served.address, request, timeout=2.0)
        # The tokenizer does not cancel a request whose deadline passed: the scheduler drops
        # it at that deadline itself, so only its books can show it was dropped in time.
        after = await stats_when(
            served.scheduler_address,
            lambda s: idle(s) and s.finished["deadline"] > before.finished["deadline"],
            "the scheduler to drop the request at its deadline",
        )
        return err.value, dict(before.finished), dict(after.finished), after

    err, before, after, stats = run(scenario())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert after.get("deadline", 0) == before.get("deadline", 0) + 1
    assert after.get("cancelled", 0) == before.get("cancelled", 0)
    assert after.get("length", 0) == before.get("length", 0)  # it did not run to its end
    assert stats.kv_blocks_used == 0  # type: ignore[attr-defined]


def test_cancelling_stops_the_request_within_steps_and_frees_its_kv(served: Pipeline) -> None:
    async def scenario():  # type: ignore[no-untyped-def]
        before = await stats_when(served.scheduler_address, idle, "an idle pipeline")
        async with aio.insecure_channel(served.address) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(
                greedy(text="Tell a long story:", max_tokens=4000, ignore_eos=True)
            )
            seen = 0
            async for reply in call:
                seen += len(reply.token_ids)
                if seen >= 3:
                    break
            during = await scheduler_stats(served.scheduler_address)
            call.cancel()
        after = await stats_when(served.scheduler_address, idle, "the cancelled request to end")
        return before, during, after

    before, during, after = run(scenario())
    assert during.running == 1 and during.kv_blocks_used > 0
    assert after.finished["cancelled"] == before.finished["cancelled"] + 1
    assert after.finished["length"] == before.finished["length"]
    # One token a step: run to its end, it would have taken thousands more. The cancel crosses
    # two processes, a few steps at most on a quiet machine; this leaves room for a busy one.
    assert after.steps - during.steps < 500
    assert after.kv_blocks_used == 0


def test_stop_strings_end_the_text_and_the_work(served: Pipeline, reference: Reference) -> None:
    # Far more tokens than the stop string needs: the scheduler runs on while the cancel is on
    # its way, and must not reach the request's length first, however busy the tokenizer is.
    request = greedy(text="Count from 1 to 50: 1, 2, 3,", max_tokens=4000, ignore_eos=True)
    ids = reference.tokenizer.encode_prompt(request.text, allow_special=True)
    want = reference.generate(ids, 64)
    stop = " 9,"
    assert stop in want.text, want.text
    request.stop.append(stop)

    async def scenario():  # type: ignore[no-untyped-def]
        before = await stats_when(served.scheduler_address, idle, "an idle pipeline")
        got = await stream(served.address, request)
        after = await stats_when(served.scheduler_address, idle, "the stopped request to end")
        return before, got, after

    before, got, after = run(scenario())
    assert got.finish_reason == "stop"
    assert got.text == want.text[: want.text.index(stop)]
    # The scheduler was still generating when the text matched: the tokenizer cancelled it.
    assert after.finished["cancelled"] == before.finished["cancelled"] + 1
    assert after.kv_blocks_used == 0


def test_a_repeated_prompt_hits_the_prefix_cache(served: Pipeline) -> None:
    text = "Shared memory lets two processes see the same bytes. " * 6

    async def scenario():  # type: ignore[no-untyped-def]
        before = await stats_when(served.scheduler_address, idle, "an idle pipeline")
        first = await stream(served.address, greedy(text=text, max_tokens=4))
        second = await stream(served.address, greedy(text=text, max_tokens=4))
        after = await scheduler_stats(served.scheduler_address)
        return before, first, second, after

    before, first, second, after = run(scenario())
    assert first.usage is not None and second.usage is not None
    assert first.usage.cached_prompt_tokens == 0
    # Every full block but the one holding the last prompt token (it is recomputed).
    block = 16
    assert second.usage.cached_prompt_tokens == (len(second.prompt_ids) - 1) // block * block
    assert after.prefix_cache_hits - before.prefix_cache_hits == second.usage.cached_prompt_tokens


def test_a_preempted_sequence_keeps_to_its_output_format(tmp_path: Path) -> None:
    """One sequence slot: a request held to a regex is preempted part-way by a higher-priority
    one, resumed (the worker follows its grammar again from what it had written), and its whole
    text still matches."""
    numbers = r"( [0-9]{1,3}){40}"
    with pipeline(tmp_path, "--max-num-seqs", "1") as served:

        async def scenario():  # type: ignore[no-untyped-def]
            part_way = asyncio.Event()

            def on_reply(s: Streamed) -> None:
                if len(s.token_ids) >= 10:
                    part_way.set()

            # Long enough that its resumption finds whole blocks of it in the prefix cache and
            # starts after them: the worker must be given the tokens before.
            prompt = "Here is a list of numbers, one after another, counting up from one to forty:"
            held = greedy(text=prompt * 2, max_tokens=400, output_format={"regex": numbers})
            low = asyncio.create_task(stream(served.address, held, on_reply=on_reply))
            await part_way.wait()
            high = await stream(served.address, greedy(text="Hi", max_tokens=4, priority=10))
            done = await low
            stats = await stats_when(served.scheduler_address, idle, "the two requests")
            return high, done, stats

        high, done, stats = run(scenario())
    assert stats.preemptions == 1 and high.finish_reason == "length"
    assert done.finish_reason == "stop" and re.fullmatch(numbers, done.text), done.text
    assert stats.kv_blocks_used == 0


def test_priority_and_backpressure(tmp_path: Path) -> None:
    """One sequence slot, a queue of four: a high-priority request takes the slot from a running
    one and runs before every waiting one; a fifth waiting request is refused."""
    flags = ("--max-num-seqs", "1", "--max-queued-requests", "4")
    with pipeline(tmp_path, *flags) as served:
        sched = served.scheduler_address

        async def scenario():  # type: ignore[no-untyped-def]
            firsts: dict[str, int] = {}
            seen: dict[str, asyncio.Event] = {}

            def long(name: str, priority: int, tokens: int) -> asyncio.Task[Streamed]:
                seen[name] = asyncio.Event()

                def first_token(s: Streamed) -> None:
                    if s.token_ids and name not in firsts:
                        firsts[name] = len(firsts)
                        seen[name].set()

                request = greedy(
                    text=f"Request {name}:", max_tokens=tokens, ignore_eos=True, priority=priority
                )
                return asyncio.create_task(stream(served.address, request, on_reply=first_token))

            running = long("running", 0, 4000)
            await seen["running"].wait()
            lows = [long(f"low{i}", 0, 4) for i in range(3)]
            await stats_when(sched, lambda s: s.waiting == 3, "three waiting requests")
            high = long("high", 10, 4000)
            # It preempts "running": three low and one preempted request now wait.
            await stats_when(sched, lambda s: s.waiting == 4 and s.preemptions == 1, "preemption")
            with pytest.raises(aio.AioRpcError) as overflow:
                await stream(served.address, greedy(text="Overflow:", max_tokens=4))
            async with httpx.AsyncClient(base_url=served.http_url, timeout=60) as http:
                body = {"prompt": "Overflow:", "max_tokens": 4}
                refused = await http.post("/completions", json=body)
            await seen["high"].wait()
            high.cancel()
            running.cancel()
            done = await asyncio.gather(*lows)
            return overflow.value, refused, firsts, done

        overflow, refused, firsts, lows = asyncio.run(scenario())
    assert overflow.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The HTTP door says the same, and when to try again (OpenAI's SDKs wait that long).
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert all(low.finish_reason == "length" for low in lows)
    assert firsts["high"] < min(firsts[f"low{i}"] for i in range(3))
