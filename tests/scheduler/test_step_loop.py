"""The scheduler's loop gets its worker back whatever attaching it again goes through.

A worker that is lost is waited for until it returns: an attempt to attach it that fails (the
worker not up yet, a call that breaks, anything raised) is made again on a new channel, never
the end of the task that receives outcomes (which left the scheduler without a worker for good).
"""

from __future__ import annotations

import asyncio

import pytest

from services.launcher import free_port
from services.scheduler import loop as loop_module
from services.scheduler import worker_link
from services.scheduler.config import SchedulerConfig
from services.scheduler.loop import StepLoop
from services.scheduler.routes import Routes
from services.scheduler.worker_link import WorkerGone, WorkerLink
from tandem.internal.v1 import hotpath_pb2 as hp

MODEL = hp.ModelDescription(
    name="fake", vocab_size=100, max_seq_len=256, num_kv_blocks=64, block_size=16
)


class FlakyLink:
    """A worker link whose connects go as `attempts` says (None: success), and whose one
    outcome is the worker's loss."""

    address = "127.0.0.1:1"

    def __init__(self, attempts: list[BaseException | None]) -> None:
        self.attempts = attempts
        self.connects = 0
        self.reopened = 0
        self.lost = False

    async def connect(self) -> hp.ModelDescription:
        outcome = self.attempts[self.connects]
        self.connects += 1
        if outcome is not None:
            raise outcome
        return MODEL

    async def reopen(self) -> None:
        self.reopened += 1

    async def receive(self) -> hp.StepOutcome:
        if not self.lost:
            self.lost = True
            raise WorkerGone("Worker.Step failed: UNAVAILABLE")
        await asyncio.Event().wait()  # no more outcomes
        raise AssertionError("unreachable")

    def send(self, desc: hp.StepDescriptor) -> None:
        raise AssertionError("nothing is planned: no request was submitted")

    async def close(self) -> None:
        pass


def run_until_back(link: FlakyLink) -> StepLoop:
    async def scenario() -> StepLoop:
        loop = StepLoop(
            link,  # type: ignore[arg-type]
            Routes(),
            lambda m: SchedulerConfig(
                num_kv_blocks=m.num_kv_blocks, block_size=m.block_size, max_model_len=256
            ),
        )
        await loop.start()
        try:
            async with asyncio.timeout(60):  # a hang fails the test; it takes milliseconds
                while not (loop.worker_restarts == 1 and loop.ready.is_set()):
                    await asyncio.sleep(0.01)
        finally:
            await loop.stop()
        return loop

    return asyncio.run(scenario())


@pytest.fixture(autouse=True)
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop_module, "RECONNECT_PAUSE_S", 0.0)


def test_a_failed_attach_is_tried_again_until_the_worker_is_back() -> None:
    link = FlakyLink(
        [
            None,  # the first start
            WorkerGone("DEADLINE_EXCEEDED: the worker is still loading"),
            RuntimeError("something no one foresaw"),
            None,
        ]
    )
    loop = run_until_back(link)
    assert link.connects == 4
    assert link.reopened == 2  # each failed attempt starts over on a new channel
    assert loop.lost is not None and "UNAVAILABLE" in loop.lost[1]


def test_the_first_attach_is_tried_again_too() -> None:
    link = FlakyLink([WorkerGone("DEADLINE_EXCEEDED: no worker yet"), None, None])
    loop = run_until_back(link)
    assert link.connects == 3 and loop.ready.is_set()


def test_an_attempt_to_attach_waits_a_bounded_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens at the worker's address: the attempt ends, naming the deadline."""
    monkeypatch.setattr(worker_link, "ATTACH_WAIT_S", 0.5)

    async def attempt() -> str:
        link = WorkerLink(f"127.0.0.1:{free_port()}", shared_memory=False)
        try:
            async with asyncio.timeout(60):
                with pytest.raises(WorkerGone) as gone:
                    await link.connect()
        finally:
            await link.close()
        return str(gone.value)

    assert asyncio.run(attempt()).startswith("DEADLINE_EXCEEDED")
