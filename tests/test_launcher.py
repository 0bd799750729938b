"""The launcher's supervision, with a stand-in child (a process that never reports healthy)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from services.launcher import ProcessSpec, Supervisor, free_port


async def test_a_restart_cut_short_by_shutdown_is_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Stopping the server while a crashed child is being started again stops that child: the
    launcher logs no error for it (a fault campaign counted that line as a crash)."""
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
    supervisor.stopping = True  # what stop_all does first
    restarted.send_signal(signal.SIGTERM)
    async with asyncio.timeout(60):
        await watcher
    assert restarted.returncode is not None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
