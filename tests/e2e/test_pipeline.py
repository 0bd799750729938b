"""The three-process pipeline end to end: real processes on loopback, the real default model."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc import aio

from engine.engine import Engine
from engine.generate import Generation, GenerationRequest, generate
from engine.sampling import GREEDY
from engine.tokenizer import Tokenizer, load_tokenizer
from services.local_pipeline import Pipeline, pipeline, shm_names_of
from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.internal.v1 import scheduler_pb2_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow


@dataclass
class Streamed:
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    usage: pb.Usage | None = None
    messages: int = 0


async def stream(
    address: str, request: pb.GenerateRequest, timeout: float | None = None
) -> Streamed:
    out = Streamed()
    async with aio.insecure_channel(address) as channel:
        async for reply in generation_pb2_grpc.GenerationStub(channel).Generate(
            request, timeout=timeout
        ):
            out.messages += 1
            out.prompt_ids.extend(reply.prompt_token_ids)
            out.token_ids.extend(reply.token_ids)
            out.text += reply.text
            if reply.finish_reason:
                out.finish_reason, out.usage = reply.finish_reason, reply.usage
    return out


def greedy(
    text: str = "", chat: str = "", max_tokens: int = 24, **kw: object
) -> pb.GenerateRequest:
    request = pb.GenerateRequest(
        max_tokens=max_tokens, sampling=pb.SamplingParams(temperature=0), **kw
    )  # type: ignore[arg-type]
    if chat:
        request.chat.messages.add(role="user", content=chat)
    else:
        request.text = text
    return request


async def scheduler_stats(address: str) -> spb.StatsResponse:
    async with aio.insecure_channel(address) as channel:
        return await scheduler_pb2_grpc.SchedulerStub(channel).Stats(spb.StatsRequest())


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    with pipeline(tmp_path_factory.mktemp("pipe"), "--max-num-seqs", "32") as running:
        yield running
    pids = [p for ps in running.child_pids().values() for p in ps]
    assert pids and not shm_names_of(pids), "shared memory left behind after shutdown"


@pytest.fixture(scope="module")
def reference(default_gguf: Path) -> tuple[Engine, Tokenizer]:
    return Engine.from_path(default_gguf, kv_cache_bytes=64 << 20, progress=False), load_tokenizer(
        default_gguf
    )


def offline(reference: tuple[Engine, Tokenizer], ids: list[int], max_tokens: int) -> Generation:
    engine, tokenizer = reference
    request = GenerationRequest(ids, GREEDY, max_tokens, stop_token_ids=tokenizer.eos_token_ids)
    result = Generation(request)
    for _ in generate(engine, tokenizer, request, result):
        pass
    return result


def test_streamed_greedy_output_equals_tandem_run(served: Pipeline, reference) -> None:  # type: ignore[no-untyped-def]
    for request in (
        greedy(text="The three primary colours are"),
        greedy(chat="Name a famous bridge in San Francisco."),
    ):
        got = asyncio.run(stream(served.address, request))
        want = offline(reference, got.prompt_ids, request.max_tokens)
        assert got.token_ids == want.token_ids
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert got.usage is not None and got.usage.completion_tokens == len(want.token_ids)
        assert got.messages >= 3  # first (ids), at least one delta, the last: it streamed


def greedy_margins(reference, ids: list[int], n: int) -> tuple[list[int], list[float]]:  # type: ignore[no-untyped-def]
    """The engine's greedy tokens alone, with the logprob gap between its top two at each step."""
    from engine.batch import SeqInput
    from engine.sampling import SamplingParams

    engine, _ = reference
    params = SamplingParams(temperature=0, logprobs=2)
    table = list(range(-(-(len(ids) + n) // engine.block_size)))
    tokens: list[int] = []
    margins: list[float] = []
    step = SeqInput("m", ids, 0, table, params)
    for _ in range(n):
        (out,) = engine.step([step])
        tokens.append(out.token_id)
        margins.append(out.top_logprobs[0][1] - out.top_logprobs[1][1])
        step = SeqInput("m", [out.token_id], len(ids) + len(tokens) - 1, table, params)
    engine.release(["m"])
    return tokens, margins


def test_32_concurrent_streams_complete_correctly(served: Pipeline, reference) -> None:  # type: ignore[no-untyped-def]
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

    results = asyncio.run(run_all())
    expected = [greedy_margins(reference, results[i].prompt_ids, 16) for i in range(4)]
    for i, got in enumerate(results):
        tokens, margins = expected[i % 4]
        # Batched and alone, the arithmetic differs in rounding: compare up to the first step
        # where the reference's best two tokens are within 0.05 nats of each other.
        same = next((k for k, m in enumerate(margins) if m < 0.05), len(margins))
        same = min(same, len(got.token_ids))  # a stream that ended at its end-of-turn token
        assert same > 0 and got.token_ids[:same] == tokens[:same], f"stream {i} (prompt {i % 4})"
        assert got.finish_reason in ("stop", "length")
        assert got.usage is not None and got.usage.completion_tokens == len(got.token_ids)


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
    request_fields: dict,
    field_name: str,  # type: ignore[type-arg]
) -> None:
    with pytest.raises(aio.AioRpcError) as err:
        asyncio.run(stream(served.address, pb.GenerateRequest(**request_fields)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith(field_name)
    still = asyncio.run(stream(served.address, greedy(text="Still serving?", max_tokens=2)))
    assert len(still.token_ids) == 2


def test_deadline_exceeded_while_running(served: Pipeline) -> None:
    request = greedy(text="Count forever:", max_tokens=2000, ignore_eos=True)
    with pytest.raises(aio.AioRpcError) as err:
        asyncio.run(stream(served.address, request, timeout=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_cancelling_frees_kv_blocks_by_the_next_step(served: Pipeline) -> None:
    async def cancel_midway() -> spb.StatsResponse:
        async with aio.insecure_channel(served.address) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(
                greedy(text="Tell a long story:", max_tokens=1000, ignore_eos=True)
            )
            seen = 0
            async for reply in call:
                seen += len(reply.token_ids)
                if seen >= 3:
                    break
            during = await scheduler_stats(served.scheduler_address)
            call.cancel()
        for _ in range(200):  # the cancel crosses two processes; wait for its step boundary
            after = await scheduler_stats(served.scheduler_address)
            if after.running == 0:
                return during, after  # type: ignore[return-value]
            await asyncio.sleep(0.05)
        return during, after  # type: ignore[return-value]

    during, after = asyncio.run(cancel_midway())  # type: ignore[misc]
    assert during.running == 1 and during.kv_blocks_used > 0
    assert after.running == 0 and after.waiting == 0 and after.kv_blocks_used == 0


def test_priority_and_backpressure(tmp_path: Path) -> None:
    flags = ("--max-num-seqs", "1", "--max-queued-requests", "4")
    with pipeline(tmp_path, *flags) as served:

        async def scenario() -> tuple[list[str], list[BaseException | Streamed]]:
            order: list[str] = []

            async def run(name: str, priority: int, tokens: int) -> Streamed:
                got = await stream(
                    served.address,
                    greedy(
                        text=f"Request {name}:",
                        max_tokens=tokens,
                        ignore_eos=True,
                        priority=priority,
                    ),
                )
                order.append(name)
                return got

            # Long enough to be running still when the queue is full.
            first = asyncio.create_task(run("running", 0, 400))
            await asyncio.sleep(0.5)  # it occupies the only sequence slot
            lows = [asyncio.create_task(run(f"low{i}", 0, 8)) for i in range(3)]
            await asyncio.sleep(0.5)
            # Still running at the overflow: it takes the slot from "running" at once, and must
            # hold it past the next 0.5 s however fast the CPU decodes (~3 s at 8 ms a token).
            high = asyncio.create_task(run("high", 10, 400))
            await asyncio.sleep(0.5)
            # Three low and one high priority request wait: the queue is full.
            overflow = asyncio.create_task(run("overflow", 0, 4))
            results = await asyncio.gather(first, *lows, overflow, high, return_exceptions=True)
            return order, list(results)

        order, results = asyncio.run(scenario())
    overflow = results[4]
    assert isinstance(overflow, aio.AioRpcError)
    assert overflow.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The high-priority request overtakes every waiting low-priority one.
    assert order.index("high") < min(order.index(f"low{i}") for i in range(3))


def test_worker_killed_mid_stream(tmp_path: Path) -> None:
    with pipeline(tmp_path, "--max-num-seqs", "8") as served:
        worker_pid = served.child_pids()["worker"][0]

        async def scenario() -> list[BaseException | Streamed]:
            requests = [
                stream(served.address, greedy(text=f"Story {i}:", max_tokens=2000, ignore_eos=True))
                for i in range(4)
            ]
            tasks = [asyncio.create_task(r) for r in requests]
            await asyncio.sleep(2.0)
            os.kill(worker_pid, signal.SIGKILL)
            return list(await asyncio.gather(*tasks, return_exceptions=True))

        results = asyncio.run(scenario())
        for result in results:
            assert isinstance(result, aio.AioRpcError), result
            assert result.code() == grpc.StatusCode.UNAVAILABLE
            assert "worker" in (result.details() or "")

        async def until_back() -> Streamed:
            for _ in range(600):
                stats = await scheduler_stats(served.scheduler_address)
                if stats.worker_ready and stats.worker_restarts == 1:
                    return await stream(served.address, greedy(text="Back?", max_tokens=4))
                await asyncio.sleep(0.2)
            raise TimeoutError("the worker did not come back")

        again = asyncio.run(until_back())
        assert len(again.token_ids) == 4
        assert not shm_names_of([worker_pid]), "the killed worker's segments were not reaped"
    pids = [p for ps in served.child_pids().values() for p in ps]
    assert not shm_names_of(pids)
