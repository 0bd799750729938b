"""The launcher's supervision, with a stand-in child (a process that never reports healthy)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from services.launcher import ProcessSpec, Supervisor, free_port


@pytest.mark.parametrize("ended_by", ["shutdown", "another kill"])
async def test_a_restart_cut_short_is_logged_once_and_no_error(
    caplog: pytest.LogCaptureFixture, ended_by: str
) -> None:
    """A crashed child being started again is stopped by the server's shutdown, or killed again:
    the launcher logs no error for it, and the second kill once, as the exit it restarts from (a
    fault campaign counted each such line as a crash)."""
    spec = ProcessSpec(
        name="stand-in",
        module="http.server",  # runs until signalled and never answers gRPC health
        args=["0", "--bind", "127.0.0.1"],
        health_address=f"127.0.0.1:{free_port()}",
        stop_grace_s=10,
    )
    supervisor = Supervisor([spec], dict(os.environ), ready_timeout_s=120)
    child = supervisor.children[0]
    await supervisor._start(child)
    assert child.proc is not None
    first = child.proc
    watcher = asyncio.create_task(supervisor._watch(child))
    first.kill()
    async with asyncio.timeout(60):
        while child.proc is first:  # restarted after its delay; now waiting for it to be healthy
            await asyncio.sleep(0.05)
    restarted = child.proc
    assert restarted is not None
    caplog.set_level(logging.INFO, logger="tandem.launcher")
    caplog.clear()  # the first kill's line
    if ended_by == "another kill":
        restarted.kill()
        async with asyncio.timeout(60):
            while child.proc is restarted:
                await asyncio.sleep(0.05)
    supervisor.stopping = True  # what stop_all does first
    assert child.proc is not None
    last = child.proc
    last.send_signal(signal.SIGTERM)
    async with asyncio.timeout(60):
        await watcher
    assert last.returncode is not None
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for level, m in messages if level >= logging.ERROR] == []
    exits = [m for _, m in messages if "exited with code" in m]
    assert exits == (["stand-in exited with code -9; restarting in 2.0 s (restart 2)"]
                     if ended_by == "another kill" else [])  # fmt: skip
