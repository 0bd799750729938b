"""Every process's crash survived: SIGKILL under load, over shared memory and over gRPC.

A killed process ends the streams that depended on it at once with UNAVAILABLE (none hangs:
every wait here is bounded), the launcher starts it again, the processes that outlived it
attach to the new one and forget the old one's requests, the next request succeeds, and the
dead process's shared memory is reaped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.pipeline import Pipeline, pipeline, shm_names_of
from tandem.v1 import generation_pb2 as pb
from tests.e2e.client import RESTART_S, WAIT_S, Streamed, greedy, idle, stats_when, stream

pytestmark = pytest.mark.slow

TRANSPORTS = ["shm", "grpc"]
STREAMS = 16


def long_request(i: int) -> pb.GenerateRequest:
    return greedy(text=f"Story number {i}:", max_tokens=4000, ignore_eos=True)


# Repetition penalties keep per-sequence history in the worker: a worker that kept a dead
# scheduler's state would answer this differently after the restart.
PROBE = pb.GenerateRequest(
    text="the cat sat on the mat and the cat sat on the mat and",
    max_tokens=12,
    ignore_eos=True,
    sampling=pb.SamplingParams(temperature=0, repetition_penalty=1.4, frequency_penalty=0.5),
)


async def under_load(
    address: str, kill: Callable[[], None], n: int = STREAMS
) -> list[BaseException | Streamed]:
    """n long streams; once every one has a token, `kill()`; what each stream ended with."""
    started = [asyncio.Event() for _ in range(n)]

    def on_reply(i: int) -> Callable[[Streamed], None]:
        return lambda s: started[i].set() if s.token_ids else None

    tasks = [
        asyncio.create_task(stream(address, long_request(i), on_reply=on_reply(i)))
        for i in range(n)
    ]
    async with asyncio.timeout(RESTART_S):  # a busy machine prefills 16 prompts slowly
        for event in started:
            await event.wait()
    kill()
    async with asyncio.timeout(WAIT_S):  # none hangs
        return list(await asyncio.gather(*tasks, return_exceptions=True))


async def until_served(address: str, request: pb.GenerateRequest) -> Streamed:
    """The first answer to `request` once the pipeline serves again (UNAVAILABLE meanwhile)."""
    async with asyncio.timeout(RESTART_S):
        while True:
            try:
                return await stream(address, request)
            except aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            await asyncio.sleep(0.2)


async def serving(address: str) -> None:
    async with aio.insecure_channel(address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=RESTART_S, wait_for_ready=True
        )
        async for reply in watch:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                watch.cancel()
                return


def assert_unavailable(results: list[BaseException | Streamed], who: str) -> None:
    for result in results:
        assert isinstance(result, aio.AioRpcError), result
        assert result.code() == grpc.StatusCode.UNAVAILABLE, result
        assert who in (result.details() or ""), result.details()


def restarted(served: Pipeline, name: str) -> bool:
    return len(served.child_pids().get(name, [])) >= 2


def wait_restarted(served: Pipeline, name: str) -> None:
    """Until the launcher's log shows `name` started again: it restarts a crashed process after a
    back-off, maybe after it printed that it serves, and another thread reads its log."""
    deadline = time.monotonic() + RESTART_S
    while not restarted(served, name):
        assert time.monotonic() < deadline, f"{name} was not started again in {RESTART_S:.0f} s"
        time.sleep(0.05)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_worker_killed_under_load(tmp_path: Path, transport: str) -> None:
    flags = ("--max-num-seqs", str(STREAMS), "--transport", transport)
    with pipeline(tmp_path, *flags) as served:
        before = asyncio.run(stream(served.address, PROBE))
        dead: list[int] = []
        results = asyncio.run(
            under_load(served.address, lambda: dead.append(served.kill("worker")))
        )
        assert_unavailable(results, "worker")

        async def recovered() -> tuple[Streamed, object]:
            await stats_when(
                served.scheduler_address,
                lambda s: s.worker_ready and s.worker_restarts == 1,
                "the worker to come back",
                RESTART_S,
            )
            again = await until_served(served.address, PROBE)
            return again, await stats_when(served.scheduler_address, idle, "an idle pipeline")

        again, stats = asyncio.run(recovered())
        assert again.token_ids == before.token_ids
        assert stats.kv_blocks_used == 0  # type: ignore[attr-defined]
        assert not shm_names_of(dead), "the killed worker's segments were not reaped"
    assert not shm_names_of([p for ps in served.child_pids().values() for p in ps])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_scheduler_killed_under_load(tmp_path: Path, transport: str) -> None:
    flags = ("--max-num-seqs", str(STREAMS), "--transport", transport)
    with pipeline(tmp_path, *flags) as served:
        before = asyncio.run(stream(served.address, PROBE))
        dead: list[int] = []
        results = asyncio.run(
            under_load(served.address, lambda: dead.append(served.kill("scheduler")))
        )
        assert_unavailable(results, "scheduler")
        # The tokenizer and the worker attach to the new scheduler; the worker forgot the dead
        # one's sequences, so the probe's penalties see only its own history.
        again = asyncio.run(until_served(served.address, PROBE))
        assert again.token_ids == before.token_ids
        wait_restarted(served, "scheduler")
        stats = asyncio.run(stats_when(served.scheduler_address, idle, "an idle pipeline"))
        assert stats.kv_blocks_used == 0 and stats.finished["length"] == 1
        assert not shm_names_of(dead), "the killed scheduler's segments were not reaped"
    assert not shm_names_of([p for ps in served.child_pids().values() for p in ps])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_tokenizer_of_two_killed(tmp_path: Path, transport: str) -> None:
    flags = ("--max-num-seqs", str(STREAMS), "--tokenizers", "2", "--transport", transport)
    with pipeline(tmp_path, *flags) as served:
        # Each tokenizer serves the public API on its own port too: the test picks which.
        one, two = served.latest("tokenizer-1"), served.latest("tokenizer-2")

        async def scenario() -> tuple[list[BaseException | Streamed], list[Streamed], object]:
            survivors = [
                asyncio.create_task(stream(two.address, greedy(text=f"Tale {i}:", max_tokens=48)))
                for i in range(4)
            ]
            doomed = await under_load(one.address, lambda: os.kill(one.pid, signal.SIGKILL), 8)
            kept = await asyncio.gather(*survivors)
            # The dead tokenizer's requests are cancelled in the scheduler: KV freed at once,
            # not after their thousands of tokens.
            stats = await stats_when(
                served.scheduler_address,
                lambda s: idle(s) and s.finished["cancelled"] >= 8,
                "the dead tokenizer's requests to be cancelled",
            )
            await serving(served.latest("tokenizer-1").address)
            return doomed, kept, stats

        doomed, kept, stats = asyncio.run(scenario())
        for result in doomed:
            assert isinstance(result, aio.AioRpcError), result
            assert result.code() == grpc.StatusCode.UNAVAILABLE
        assert all(s.finish_reason == "length" and len(s.token_ids) == 48 for s in kept)
        assert stats.kv_blocks_used == 0  # type: ignore[attr-defined]
        wait_restarted(served, "tokenizer-1")
        back = asyncio.run(stream(served.latest("tokenizer-1").address, greedy(text="Hi")))
        assert back.finish_reason in ("stop", "length")
        assert not shm_names_of([one.pid])
    assert not shm_names_of([p for ps in served.child_pids().values() for p in ps])


@pytest.mark.parametrize(
    ("when", "victim"),
    [
        ("tokenizer-2", "tokenizer-1"),  # it has served; another is still starting
        ("tokenizer-1", "tokenizer-1"),  # killed while it starts itself
        ("scheduler", "worker"),  # the scheduler is starting against it
    ],
)
def test_a_crash_during_start_up_is_recovered(tmp_path: Path, when: str, victim: str) -> None:
    killed: list[int] = []

    def kill(p: Pipeline) -> None:
        killed.append(p.kill(victim))

    with pipeline(tmp_path, "--tokenizers", "2", on_started={when: kill}) as served:
        assert killed, f"{when} never started"
        wait_restarted(served, victim)
        got = asyncio.run(until_served(served.address, greedy(text="Still here?", max_tokens=4)))
        assert len(got.token_ids) == 4
        for name in ("tokenizer-1", "tokenizer-2"):
            asyncio.run(serving(served.latest(name).address))
        assert f"{victim} exited" in served.log() or f"{victim} was killed" in served.log()
    assert not shm_names_of([p for ps in served.child_pids().values() for p in ps])


def test_a_killed_rank_restarts_the_tensor_parallel_group(tmp_path: Path) -> None:
    """A worker of two ranks: one killed ends the worker, the launcher starts the whole group
    again, and the next request is served."""
    with pipeline(tmp_path, "--tensor-parallel-size", "2") as served:
        killed_rank(served)


def follower_ranks(worker_pid: int) -> list[int]:
    """The worker's rank processes (multiprocessing's spawned children; not its helpers)."""
    out = []
    for task in os.listdir(f"/proc/{worker_pid}/task"):
        children = Path(f"/proc/{worker_pid}/task/{task}/children").read_text().split()
        for child in children:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(int(child))
    return out


def killed_rank(served: Pipeline) -> None:
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
    wait_restarted(served, "worker")
    assert served.latest("worker").pid != worker  # the launcher started the worker again
    assert len(follower_ranks(served.latest("worker").pid)) == 1
    assert not shm_names_of([worker, rank])
