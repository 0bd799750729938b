"""Garbage written into the pipeline's shared memory by a rogue process of the same user
(harness/rogue.py), while requests stream.

A ring carries every step (or every token event) of one link, so a corrupt ring ends that link:
the requests in flight on it fail with UNAVAILABLE naming the lost link, the link is attached
afresh, the next request succeeds, and no process exits. Nothing hangs: every wait here is
bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc import aio

from harness import rogue
from harness.pipeline import Pipeline, pipeline, shm_names_of
from tandem.v1 import generation_pb2 as pb
from tests.e2e.client import WAIT_S, Streamed, greedy, idle, stats_when, stream
from tests.e2e.test_crashes import until_served

pytestmark = pytest.mark.slow

STREAMS = 4


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
            await asyncio.to_thread(rogue.resume, writer, readers)
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
