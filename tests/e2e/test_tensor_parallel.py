"""A worker of two tensor-parallel ranks (gloo on CPU) behind the real pipeline.

In fp32 with dequantized weights its tokens are the single-process engine's: only the order of
the all-reduce's sums differs, so a pick may differ only at a near tie. Killing one rank ends the
worker, the launcher starts the whole group again, and the next request is served.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio

from harness.pipeline import Pipeline, pipeline, shm_names_of
from tests.e2e.client import RESTART_S, Reference, Streamed, greedy, idle, stats_when, stream
from tests.e2e.test_crashes import until_served

pytestmark = pytest.mark.slow

NEAR_TIE = 1e-3
FLAGS = ("--tensor-parallel-size", "2", "--dtype", "float32", "--quantize", "none")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    with pipeline(tmp_path_factory.mktemp("tp"), "--max-num-seqs", "8", *FLAGS) as running:
        yield running


@pytest.fixture(scope="module")
def reference(default_gguf: Path) -> Reference:
    return Reference(default_gguf, dtype="float32", quantize="none")


def assert_greedy(reference: Reference, got: Streamed) -> None:
    tops = reference.forced(got.prompt_ids, got.token_ids)
    for k, (top, token) in enumerate(zip(tops, got.token_ids, strict=True)):
        if token != top[0][0]:
            assert top[0][1] - top[1][1] < NEAR_TIE, f"token {k}: {token}, the engine's {top}"


def test_two_ranks_give_the_engines_greedy_tokens(served: Pipeline, reference: Reference) -> None:
    async def run_all() -> list[Streamed]:
        prompts = ["The three primary colours are", "def fibonacci(n):", "Paris is"]
        requests = [greedy(text=prompts[i % 3], max_tokens=12) for i in range(6)]
        return await asyncio.gather(*(stream(served.address, r) for r in requests))

    for got in asyncio.run(run_all()):
        assert got.finish_reason in ("stop", "length")
        assert_greedy(reference, got)


def follower_ranks(worker_pid: int) -> list[int]:
    """The worker's rank processes (multiprocessing's spawned children; not its helpers)."""
    out = []
    for task in os.listdir(f"/proc/{worker_pid}/task"):
        for child in open(f"/proc/{worker_pid}/task/{task}/children").read().split():
            cmdline = open(f"/proc/{child}/cmdline", "rb").read()
            if b"spawn_main" in cmdline:
                out.append(int(child))
    return out


def test_a_killed_rank_restarts_the_group(served: Pipeline) -> None:
    worker = served.latest("worker").pid
    (rank,) = follower_ranks(worker)

    async def scenario() -> tuple[BaseException | Streamed, Streamed]:
        started = asyncio.Event()
        request = greedy(text="Tell a long story:", max_tokens=4000, ignore_eos=True)
        running = asyncio.create_task(
            stream(served.address, request, on_reply=lambda s: s.token_ids and started.set())
        )
        async with asyncio.timeout(RESTART_S):
            await started.wait()
        os.kill(rank, signal.SIGKILL)
        ended = await asyncio.wait_for(
            asyncio.gather(running, return_exceptions=True), timeout=RESTART_S
        )
        await stats_when(
            served.scheduler_address,
            lambda s: s.worker_ready and s.worker_restarts == 1,
            "the worker group to come back",
            RESTART_S,
        )
        again = await until_served(served.address, greedy(text="Back?", max_tokens=4))
        await stats_when(served.scheduler_address, idle, "an idle pipeline")
        return ended[0], again

    ended, again = asyncio.run(scenario())
    assert isinstance(ended, aio.AioRpcError) and ended.code() == grpc.StatusCode.UNAVAILABLE
    assert len(again.token_ids) == 4
    assert served.latest("worker").pid != worker  # the launcher started the worker again
    assert len(follower_ranks(served.latest("worker").pid)) == 1
    assert not shm_names_of([worker, rank])
