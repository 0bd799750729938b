"""The scheduler's loop gets its worker back whatever attaching it again goes through.

A worker that is lost is waited for until it returns: an attempt to attach it that fails (the
worker not up yet, a call that breaks, anything raised) is made again on a new channel, never
the end of the task that receives outcomes (which left the scheduler without a worker for good).
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.errors import CannotStart
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


def test_a_model_the_policy_cannot_schedule_stops_the_start_naming_why() -> None:
    """Chunked prefill off with a budget below the model's contexts: no retry makes it fit."""

    def policy(m: hp.ModelDescription) -> SchedulerConfig:
        return SchedulerConfig(
            num_kv_blocks=m.num_kv_blocks,
            block_size=m.block_size,
            max_model_len=m.max_seq_len,
            enable_chunked_prefill=False,
            max_num_batched_tokens=128,
        )

    async def scenario() -> str:
        loop = StepLoop(FlakyLink([None]), Routes(), policy)  # type: ignore[arg-type]
        try:
            with pytest.raises(CannotStart) as refused:
                await loop.start()
        finally:
            await loop.stop()
        assert not loop.ready.is_set()
        return str(refused.value)

    said = asyncio.run(scenario())
    assert "serves fake (contexts of up to 256 tokens" in said
    assert "max_num_batched_tokens must be >= max_model_len" in said and "(128 < 256)" in said


def test_a_later_worker_the_policy_cannot_schedule_is_waited_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a restart the scheduler keeps waiting for a worker it can schedule, saying why
    once, not at every attempt."""
    calls = 0

    def policy(m: hp.ModelDescription) -> SchedulerConfig:
        nonlocal calls
        calls += 1  # the first worker fits; the next three that attach do not
        return SchedulerConfig(
            num_kv_blocks=m.num_kv_blocks,
            block_size=m.block_size,
            max_model_len=m.max_seq_len,
            enable_chunked_prefill=False,
            max_num_batched_tokens=128 if 2 <= calls <= 4 else 256,
        )

    async def scenario() -> StepLoop:
        loop = StepLoop(FlakyLink([None] * 6), Routes(), policy)  # type: ignore[arg-type]
        await loop.start()
        try:
            async with asyncio.timeout(60):
                while not (loop.worker_restarts == 1 and loop.ready.is_set()):
                    await asyncio.sleep(0.01)
        finally:
            await loop.stop()
        return loop

    with caplog.at_level(logging.ERROR, logger=loop_module.__name__):
        loop = asyncio.run(scenario())
    assert calls == 5 and loop.core is not None
    assert loop.core.config.max_num_batched_tokens == 256
    said = [r.getMessage() for r in caplog.records if "cannot" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("; waiting for a worker it can")


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
