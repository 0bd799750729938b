"""Garbage written into the pipeline's shared memory by a rogue process of the same user
(harness/rogue.py), while requests stream.

A ring carries every step (or every token event) of one link, so a corrupt ring ends that link:
the requests in flight on it fail with UNAVAILABLE naming the lost link, the link is attached
afresh, the next request succeeds, and no process exits. Nothing hangs: every wait here is
bounded.
"""

from __future__ import annotations

import asyncio
import re
import struct
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc import aio

from harness import rogue
from harness.pipeline import Pipeline, pipeline, shm_names_of
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.e2e.client import WAIT_S, Streamed, greedy, idle, stats_when, stream
from tests.e2e.test_crashes import until_served

pytestmark = pytest.mark.slow

STREAMS = 4
_ARENA_IN_USE = re.compile(r'tandem_shm_bytes_in_use\{[^}]*segment="prompt_arena"[^}]*\} (\S+)')


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    with pipeline(tmp_path_factory.mktemp("rogue"), "--max-num-seqs", "8") as running:
        yield running
    pids = [p for ps in running.child_pids().values() for p in ps]
    assert not shm_names_of(pids), "shared memory left behind after shutdown"


def _ring(served: Pipeline, which: str) -> tuple[str, int, list[int]]:
    """The ring's segment name, its writer's pid and its reader's."""
    scheduler, worker = served.latest("scheduler").pid, served.latest("worker").pid
    tokenizer = served.latest("tokenizer-1").pid
    if which == "result":
        return rogue.segments(worker, "ring")[0], worker, [scheduler]
    rings = rogue.segments(scheduler, "ring")  # the step ring is twice an event ring's size
    if which == "step":
        return rings[-1], scheduler, [worker]
    return rings[0], scheduler, [tokenizer]


def _long(i: int) -> pb.GenerateRequest:
    return greedy(text=f"Chapter {i}:", max_tokens=4000, ignore_eos=True)


async def _streaming(address: str) -> list[asyncio.Task[Streamed]]:
    """STREAMS long streams, each with a token already."""
    started = [asyncio.Event() for _ in range(STREAMS)]

    def on_reply(i: int) -> Callable[[Streamed], None]:
        return lambda s: started[i].set() if s.token_ids else None

    tasks = [
        asyncio.create_task(stream(address, _long(i), on_reply=on_reply(i))) for i in range(STREAMS)
    ]
    async with asyncio.timeout(WAIT_S):
        for event in started:
            await event.wait()
    return tasks


@pytest.mark.parametrize("mode", ["ring-garbage", "ring-forge"])
@pytest.mark.parametrize(
    ("which", "link"),
    [("step", "lost the worker"), ("result", "lost the worker"), ("events", "lost the scheduler")],
)
def test_a_corrupt_ring_ends_its_link_and_only_that(
    served: Pipeline, which: str, link: str, mode: str
) -> None:
    async def scenario() -> tuple[list[BaseException | Streamed], Streamed, object]:
        tasks = await _streaming(served.address)
        name, writer, readers = _ring(served, which)
        rogue.stop([writer, *readers])
        try:
            wrote = rogue.scribble(mode, name, seed=7)
        finally:
            await asyncio.to_thread(rogue.resume_once_read, writer, readers, name, WAIT_S)
        assert "nothing written" not in wrote, wrote
        async with asyncio.timeout(WAIT_S):  # none hangs
            ended = list(await asyncio.gather(*tasks, return_exceptions=True))
        again = await until_served(served.address, greedy(text="Still here?", max_tokens=4))
        return ended, again, await stats_when(served.scheduler_address, idle, "an idle pipeline")

    ended, again, stats = asyncio.run(scenario())
    for result in ended:
        assert isinstance(result, aio.AioRpcError), result
        assert result.code() == grpc.StatusCode.UNAVAILABLE, result
        assert link in (result.details() or ""), result.details()
    assert len(again.token_ids) == 4
    assert stats.kv_blocks_used == 0  # type: ignore[attr-defined]
    assert "exited with code" not in served.log()


def _arena_bytes_in_use(served: Pipeline) -> int:
    with urllib.request.urlopen(served.metrics["tokenizer-1"], timeout=10) as reply:
        text = reply.read().decode()
    return sum(int(float(m[1])) for m in _ARENA_IN_USE.finditer(text))


async def _tokenize(address: str, text: str) -> list[int]:
    async with aio.insecure_channel(address) as channel:
        reply = await generation_pb2_grpc.GenerationStub(channel).Tokenize(
            pb.TokenizeRequest(text=text), timeout=WAIT_S
        )
    return list(reply.token_ids)


@pytest.mark.parametrize(
    ("mode", "why"), [("arena-data", "outside [0,"), ("arena-gen", "stale generation")]
)
def test_a_prompt_written_over_fails_its_request_alone(
    served: Pipeline, mode: str, why: str
) -> None:
    async def scenario() -> tuple[BaseException | Streamed, list[BaseException | Streamed]]:
        started = [asyncio.Event() for _ in range(STREAMS)]
        others = [
            asyncio.create_task(
                stream(
                    served.address,
                    greedy(text=f"Verse {i}:", max_tokens=24, ignore_eos=True),
                    on_reply=lambda s, i=i: started[i].set() if s.token_ids else None,
                )
            )
            for i in range(STREAMS - 1)
        ]
        async with asyncio.timeout(WAIT_S):
            for event in started[: STREAMS - 1]:
                await event.wait()
        text = f"The victim's own words, {mode}: zebra quartz lantern harbour"
        ids = await _tokenize(served.address, text)
        needle = struct.pack(f"<{len(ids)}i", *ids)
        worker = served.latest("worker").pid
        submitted = asyncio.Event()
        rogue.stop([worker])  # the worker reads the victim's prompt only after the rogue
        try:
            victim = asyncio.create_task(
                stream(
                    served.address,
                    greedy(text=text, max_tokens=8, ignore_eos=True),
                    on_reply=lambda _: submitted.set(),
                )
            )
            async with asyncio.timeout(WAIT_S):
                await submitted.wait()  # the first reply comes once the scheduler has it
            arena = rogue.segments(served.latest("tokenizer-1").pid, "arena")[0]
            wrote = await asyncio.to_thread(rogue.scribble, mode, arena, 7, needle)
        finally:
            rogue.resume(None, [worker])
        assert "nothing written" not in wrote, wrote
        async with asyncio.timeout(WAIT_S):
            ended = await asyncio.gather(victim, *others, return_exceptions=True)
        await stats_when(served.scheduler_address, idle, "an idle pipeline")
        return ended[0], list(ended[1:])

    victim, others = asyncio.run(scenario())
    assert isinstance(victim, aio.AioRpcError), victim
    assert victim.code() == grpc.StatusCode.INTERNAL, victim
    assert "the worker could not run the request" in (victim.details() or ""), victim.details()
    assert why in (victim.details() or ""), victim.details()
    for other in others:  # in the victim's steps, unharmed
        assert isinstance(other, Streamed) and len(other.token_ids) == 24, other
    assert _arena_bytes_in_use(served) == 0
    assert "exited with code" not in served.log()


@pytest.mark.parametrize("mode", ["arena-table", "arena-header"])
def test_an_arena_written_over_serves_the_next_request(served: Pipeline, mode: str) -> None:
    async def scenario() -> tuple[Streamed, object]:
        arena = rogue.segments(served.latest("tokenizer-1").pid, "arena")[0]
        wrote = await asyncio.to_thread(rogue.scribble, mode, arena, 7)
        assert "random bytes" in wrote, wrote
        # The tokenizer writes its own books again with its next prompt.
        after = await stream(served.address, greedy(text="Still here?", max_tokens=4))
        return after, await stats_when(served.scheduler_address, idle, "an idle pipeline")

    after, stats = asyncio.run(scenario())
    assert len(after.token_ids) == 4
    assert stats.kv_blocks_used == 0  # type: ignore[attr-defined]
    assert _arena_bytes_in_use(served) == 0
