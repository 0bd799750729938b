"""The blocking `Client`, run in a worker thread while the fake server serves on the test's loop."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from fake_server import TRACE_ID, FakeServer, Script, restart_serving, stream

from services.client import Client, TandemError, Usage

PIECES = [("Hello", [9906]), (", world", [11, 1917])]
WAIT = 10.0


async def test_complete_and_stream(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: Script(stream(PIECES, prompt_ids=[1, 2]))

    def use() -> tuple[list[str], str, Usage | None, str]:
        with Client(fake.address) as client:
            client.wait_ready(timeout=WAIT)
            texts = [delta.text for delta in client.generate("hi", max_tokens=3)]
            result = client.complete("hi", seed=1)
            return texts, result.text, result.usage, result.trace_id

    texts, text, usage, trace_id = await asyncio.to_thread(use)
    assert texts == ["Hello", ", world"] and text == "Hello, world"
    assert usage == Usage(prompt_tokens=2, completion_tokens=3) and trace_id == TRACE_ID
    assert [r.sampling.seed for r in fake.servicer.requests] == [0, 1]


async def test_a_status_becomes_tandem_error(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: Script([], abort=(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))

    def use() -> TandemError:
        with Client(fake.address) as client, pytest.raises(TandemError) as caught:
            client.complete("hi")
        return caught.value

    err = await asyncio.to_thread(use)
    assert (err.code, err.message) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")


async def test_breaking_out_cancels_the_server_call(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: Script(stream(PIECES[:1], finish_reason=""), hang=True)

    def use() -> str:
        with Client(fake.address) as client:
            generation = client.generate("hi")
            for _ in generation:
                break
            return generation.result.text

    assert await asyncio.to_thread(use) == "Hello"
    await asyncio.wait_for(fake.servicer.cancelled.wait(), WAIT)


async def test_timeout_is_the_deadline(fake: FakeServer) -> None:
    fake.servicer.script = lambda _: Script([], hang=True)

    def use() -> TandemError:
        with Client(fake.address) as client, pytest.raises(TandemError) as caught:
            client.complete("hi", timeout=0.3)
        return caught.value

    assert (await asyncio.to_thread(use)).code == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_unary_calls(fake: FakeServer) -> None:
    def use() -> tuple[list[int], str, str]:
        with Client(fake.address) as client:
            ids = client.tokenize("Hi")
            return ids, client.detokenize(ids), client.list_models()[0].name

    assert await asyncio.to_thread(use) == ([72, 105], "Hi", "fake")


async def test_close_leaves_no_channel_or_thread_behind(fake: FakeServer) -> None:
    def use() -> tuple[Client, set[threading.Thread]]:
        before = set(threading.enumerate())  # here, so the executor's own thread is in it
        client = Client(fake.address)
        with client.generate("hi") as generation:
            for _ in generation:
                break
        client.complete("hi")
        client.close()
        return client, before

    client, before = await asyncio.to_thread(use)
    with pytest.raises(ValueError, match="Channel closed"):
        client.complete("hi")
    # grpc's thread for the calls ends on its own, just after the last call's end wakes us.
    async with asyncio.timeout(WAIT):
        while not set(threading.enumerate()) <= before:
            await asyncio.sleep(0.01)


async def test_connected_tells_a_live_server_from_none(
    fake: FakeServer, closed_address: str
) -> None:
    def use(address: str, timeout: float) -> bool:
        with Client(address) as client:
            return client.connected(timeout=timeout)

    assert await asyncio.to_thread(use, fake.address, WAIT)  # a busy machine may connect slowly
    assert not await asyncio.to_thread(use, closed_address, 0.5)


async def test_wait_ready_rides_out_a_restart(closed_address: str) -> None:
    """The server stops while the client waits (cutting its health watch) and comes back."""
    server = asyncio.create_task(restart_serving(closed_address))

    def wait() -> None:
        with Client(closed_address) as client:
            client.wait_ready(timeout=WAIT)

    try:
        await asyncio.to_thread(wait)
    finally:
        await (await server).stop(grace=0)
