"""The launcher: starts worker, scheduler and tokenizers as processes, supervises, stops them.

Start order follows the data flow's dependencies (worker, then scheduler, then tokenizers), each
awaited until its gRPC health says SERVING. A process that exits with an error before it ever
served fails the launch at once (a bad flag, a missing model: restarting would not help); one
killed by a signal while starting is started again, a few times, and so is one that could not
bind a port picked for it because another process took it meanwhile (on new ports). From the
moment a process has served, whatever else is still starting, an exit is a crash to recover from:
it is restarted (its in-flight requests fail with UNAVAILABLE in the processes that outlive it).
On SIGINT or SIGTERM the tokenizers drain first, then the scheduler and the worker stop, and what
they left in /dev/shm is reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.listen import bind_error
from shm.reaper import reap

log = logging.getLogger("tandem.launcher")

_PR_SET_PDEATHSIG = 1
# Crashes closer together than this double the wait before the next restart (up to the cap).
_RESTART_WINDOW_S = 30.0
_MAX_RESTART_DELAY_S = 10.0
# Times a process killed by a signal before it first served is started again.
_START_ATTEMPTS = 3
# A health stream ended by the server going away, and the pause before it is watched again.
_CUT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
_REWATCH_S = 0.1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _in_use(port: int) -> bool:
    return bind_error("", port) is not None


def _die_with_parent() -> None:
    # Runs in the child before exec: if the launcher is killed outright, its children get SIGTERM
    # instead of living on as orphans holding ports and shared memory.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass
class ProcessSpec:
    name: str  # e.g. "worker", "tokenizer-1"
    module: str  # run as `python -m <module>`
    args: list[str]
    health_address: str
    stop_grace_s: float
    metrics_url: str = ""  # its Prometheus endpoint, if it serves one


@dataclass
class Child:
    spec: ProcessSpec
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    last_start: float = 0.0
    delay_s: float = 0.5
    stopping: bool = False
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)


class LaunchFailed(Exception):
    """A process could not be started (it died, or never became healthy)."""


@dataclass
class Supervisor:
    env: dict[str, str]
    ready_timeout_s: float
    children: list[Child] = field(default_factory=list)  # in start order
    stopping: bool = False
    # Ports handed out or named by the user. A free port is held by nobody until its process binds
    # it, seconds later: free_port() may return it again meanwhile, and must not be believed.
    reserved: set[int] = field(default_factory=set)

    def pick_port(self) -> int:
        """A free port no process of this launch was given."""
        while (port := free_port()) in self.reserved:
            pass
        self.reserved.add(port)
        return port

    async def start(self, make: Callable[[Callable[[], int]], ProcessSpec]) -> ProcessSpec:
        """Start a process and wait until it serves. `make(port)` is its spec, on the ports the
        user set and ones `port()` picks free: made again, on new ones, if the process exits
        while starting and a port picked for it is taken."""
        picked: list[int] = []

        def port() -> int:
            picked.append(self.pick_port())
            return picked[-1]

        child = Child(make(port))
        self.children.append(child)
        for attempt in range(1, _START_ATTEMPTS + 1):
            await self._start(child)
            try:
                await self._wait_healthy(child)
                break
            except LaunchFailed:
                code = child.proc.returncode if child.proc is not None else None
                name = child.spec.name
                if code is None or attempt == _START_ATTEMPTS:
                    raise
                # It holds no port once it has exited: one it cannot have bound is another's.
                taken = [p for p in picked if _in_use(p)]
                if taken:
                    log.warning(
                        "%s could not bind port %s; starting it on new ports", name, taken[0]
                    )
                    picked.clear()
                    child.spec = make(port)
                elif code < 0:
                    log.warning(
                        "%s was killed by signal %d while starting; starting it again", name, -code
                    )
                else:
                    raise
                reap()
        # Watched from now on: once it has served, its exit is a crash to recover from.
        child.watcher = asyncio.create_task(self._watch(child))
        return child.spec

    async def _start(self, child: Child) -> None:
        child.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            child.spec.module,
            *child.spec.args,
            env=self.env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        child.last_start = time.monotonic()
        log.info(
            "started %s (pid %d) at %s", child.spec.name, child.proc.pid, child.spec.health_address
        )

    async def _wait_healthy(self, child: Child) -> None:
        """Until the process reports SERVING; LaunchFailed if it dies or times out first."""
        proc = child.proc
        if proc is None:
            raise LaunchFailed(f"{child.spec.name} was not started")
        healthy = asyncio.create_task(wait_serving(child.spec.health_address, self.ready_timeout_s))
        died = asyncio.create_task(proc.wait())
        done, _ = await asyncio.wait({healthy, died}, return_when=asyncio.FIRST_COMPLETED)
        if died in done:
            healthy.cancel()
            raise LaunchFailed(
                f"{child.spec.name} exited with code {proc.returncode} while starting"
            )
        died.cancel()
        try:
            healthy.result()
        except (TimeoutError, grpc.RpcError) as err:
            raise LaunchFailed(f"{child.spec.name} did not become healthy: {err}") from err

    async def _watch(self, child: Child) -> None:
        while not (self.stopping or child.stopping):
            proc = child.proc
            if proc is None:
                return
            code = await proc.wait()
            if self.stopping or child.stopping:
                return
            quick = time.monotonic() - child.last_start < _RESTART_WINDOW_S
            child.delay_s = min(child.delay_s * 2, _MAX_RESTART_DELAY_S) if quick else 0.5
            child.restarts += 1
            log.warning(
                "%s exited with code %s; restarting in %.1f s (restart %d)",
                child.spec.name,
                code,
                child.delay_s,
                child.restarts,
            )
            # What the dead process owned in /dev/shm (its rings, its arena) is unlinked now.
            reap()
            await asyncio.sleep(child.delay_s)
            if self.stopping:
                return
            await self._start(child)
            try:
                await self._wait_healthy(child)
                log.info("%s is back", child.spec.name)
            except LaunchFailed as err:
                # Unless the shutdown stopped it, or it died again (the loop logs that exit once),
                # say why it did not come back.
                died = child.proc is not None and child.proc.returncode is not None
                if not (self.stopping or child.stopping or died):
                    log.error("%s", err)

    async def stop_all(self) -> None:
        """Stop in reverse start order, each within its grace period, then reap shared memory."""
        self.stopping = True
        for child in reversed(self.children):
            await self._stop(child)
        for child in self.children:
            if child.watcher is not None:
                child.watcher.cancel()
        reap()

    async def _stop(self, child: Child) -> None:
        child.stopping = True
        proc = child.proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), child.spec.stop_grace_s)
        except TimeoutError:
            log.warning(
                "%s did not stop within %.0f s; killing it",
                child.spec.name,
                child.spec.stop_grace_s,
            )
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def wait_serving(address: str, timeout_s: float) -> None:
    """Wait until the gRPC health service at `address` reports SERVING (it streams changes).

    A stream the server cuts (it is stopping) is watched again until the deadline: a process whose
    start fails after the watch connected is then reported by its exit code, which names why, and
    not by the cut, which raced it (a flaky launcher test was this race)."""
    # Reconnect within a second: grpc's default back-off (up to 120 s) would see a slow starter
    # serve long after it did, and report a crash meanwhile as one "while starting".
    options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
    deadline = time.monotonic() + timeout_s
    async with aio.insecure_channel(address, options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while (left := deadline - time.monotonic()) > 0:
            watch = stub.Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=left, wait_for_ready=True
            )
            try:
                async for reply in watch:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    break
                if err.code() not in _CUT:
                    raise
            finally:
                watch.cancel()
            await asyncio.sleep(_REWATCH_S)
    raise TimeoutError(f"{address} not serving after {timeout_s:.0f} s")
