"""The process lifecycle: what start-up made is kept out of the garbage collector's reach, and
a stop signal during start-up ends the process at once."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

import services.process as process
from services.process import Service, run_service
from services.telemetry.config import TelemetryConfig, TracingSettings
from services.telemetry.tracing import Tracing


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the suite collects as usual


def tracked(obj: object) -> bool:
    """Whether a collection would walk `obj` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


async def test_what_start_up_made_is_frozen_once_the_service_has_started(
    unfrozen: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = asyncio.Event()
    monkeypatch.setattr(process, "stop_event_on_signals", lambda: stop)
    monkeypatch.setattr(process, "_exit_on_stop_signals", lambda: None)  # pytest's own signals
    made: dict[str, list[object]] = {}
    started = asyncio.Event()

    async def start() -> None:
        made["start-up"] = [object()]  # as a worker's model and graphs are made in start-up
        assert tracked(made["start-up"])
        started.set()

    async def build(tracing: Tracing) -> Service:
        return Service(
            register=lambda server: None, service_names=[], metrics=CollectorRegistry(),
            start=start,
        )  # fmt: skip

    telemetry = TelemetryConfig(
        service_name="test", tracing=TracingSettings(trace_sampler="always_off")
    )
    served = asyncio.create_task(run_service("test", "127.0.0.1:0", telemetry, build))
    try:
        await asyncio.wait_for(started.wait(), 10)
        for _ in range(100):
            if gc.get_freeze_count():
                break
            await asyncio.sleep(0.01)
        assert gc.get_freeze_count() > 0
        assert not tracked(made["start-up"])
        made["serving"] = [object()]  # what serving makes is collected as before
        assert tracked(made["serving"])
    finally:
        stop.set()
        code = await asyncio.wait_for(served, 10)
    assert code == 0


def test_what_was_frozen_is_finalized_at_exit() -> None:
    """Frozen objects left out of the interpreter's last collection are reported by Triton's
    bindings as leaks, hundreds of lines after every Ctrl-C of a worker."""
    code = "import triton; from services.process import freeze_start_up; freeze_start_up('t')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr


BLOCKED_BUILD = """
import time
from services.process import run, run_service
from services.telemetry.config import TelemetryConfig, TracingSettings

async def build(tracing):
    print("building", flush=True)
    time.sleep(600)  # holds the event loop, as a model loading or kernels compiling do

telemetry = TelemetryConfig(service_name="t", tracing=TracingSettings(trace_sampler="always_off"))
raise SystemExit(run(lambda: run_service("test", "127.0.0.1:0", telemetry, build)))
"""


def signalled(script: str, first_line: bytes, signal_name: str) -> tuple[int, bytes, bytes]:
    """Run `script` in a child, send it `signal_name` once it printed `first_line`, and return
    its exit code and what it wrote after."""
    import signal

    child = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert child.stdout is not None
    assert child.stdout.readline() == first_line
    child.send_signal(getattr(signal, signal_name))
    try:
        out, err = child.communicate(timeout=120)  # without the handling: far longer
    finally:
        child.kill()
    return child.returncode, out, err


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_the_service_is_built_ends_the_process_at_once(
    signal_name: str,
) -> None:
    """The loop sees no signal while a build holds it: the launcher killed a worker 10 s after
    Ctrl-C, and a worker started by hand ran its whole start-up first."""
    code, _, err = signalled(BLOCKED_BUILD, b"building\n", signal_name)
    assert code == 0, err.decode()
    assert b"Traceback" not in err


BLOCKED_START = """
import asyncio, sys
from prometheus_client import CollectorRegistry
from services.process import Service, run, run_service, setup_logging
from services.telemetry.config import TelemetryConfig, TracingSettings

setup_logging("test")

async def attach():
    print("attaching", flush=True)
    await asyncio.Event().wait()  # a peer that never comes (a worker still loading)

async def stop():
    print("stopped", flush=True)

async def build(tracing):
    return Service(lambda s: None, [], CollectorRegistry(), start=attach, stop=stop)

telemetry = TelemetryConfig(service_name="t", tracing=TracingSettings(trace_sampler="always_off"))
raise SystemExit(run(lambda: run_service("test", "127.0.0.1:0", telemetry, build)))
"""


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_stop_signal_while_the_service_attaches_to_its_peers_stops_it(
    signal_name: str,
) -> None:
    """A scheduler waiting for a worker that still loads took Docker's stop timeout to stop:
    the signal was seen only once it had attached."""
    code, out, err = signalled(BLOCKED_START, b"attaching\n", signal_name)
    assert code == 0, err.decode()
    assert out == b"stopped\n"  # what start made is cleaned up as at any stop
    assert b"stopped while it attached to its peers" in err
