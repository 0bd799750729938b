"""`tandem serve` under a campaign: who it killed, who crashed, what leaked, how memory grew.

crashed_processes  exits the launcher logged ("NAME exited with code C") that the campaign did
                   not cause: each SIGKILL the campaign sends accounts for one exit of that
                   process with code -9; any other exit is a crash.
leaked_shm         tandem segments and semaphores in /dev/shm created by this pipeline's
                   processes that are dead (shm.reaper.scan) once recovery is done, and any
                   left at all once `tandem serve` has stopped.
leaked_kv_blocks   the scheduler's KV blocks still held once the load has drained (running and
                   waiting 0), less those deliberately pinned for sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from grpc import aio

from harness.pipeline import Pipeline, pipeline, shm_names_of
from shm.reaper import scan
from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.internal.v1 import scheduler_pb2_grpc

_EXITED = re.compile(r"(\S+) exited with code (-?\d+)")
_KILLED_STARTING = re.compile(r"(\S+) was killed by signal (\d+) while starting")
DRAIN_S = 120.0


@dataclass
class Served:
    pipe: Pipeline
    kills: Counter[str] = field(default_factory=Counter)  # process name -> SIGKILLs sent
    shm_after_stop: list[str] = field(default_factory=list)
    stuck_on_stop: int = 0

    @property
    def address(self) -> str:
        return self.pipe.address

    def all_pids(self) -> list[int]:
        return [p.pid for p in list(self.pipe.started)]

    def kill(self, name: str) -> int:
        pid = self.pipe.latest(name).pid
        self.kills[name] += 1
        os.kill(pid, signal.SIGKILL)
        return pid

    def crashes(self) -> list[str]:
        """The exits the campaign did not cause, as "NAME exited with code C"."""
        log = self.pipe.log()
        exits = [(m[1], int(m[2])) for m in _EXITED.finditer(log)]
        exits += [(m[1], -int(m[2])) for m in _KILLED_STARTING.finditer(log)]
        budget = Counter(self.kills)
        crashed = []
        for name, code in exits:
            if code == -signal.SIGKILL and budget[name] > 0:
                budget[name] -= 1
            else:
                crashed.append(f"{name} exited with code {code}")
        return crashed

    def dead_shm(self) -> list[str]:
        """Segments and semaphores of this pipeline's processes whose owner is dead."""
        ours = {str(pid) for pid in self.all_pids()}
        return [e.path.name for e in scan() if not e.alive and str(e.pid) in ours]

    def rss_mib(self, name: str) -> float:
        pid = self.pipe.latest(name).pid
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def process_names(self) -> list[str]:
        return list(dict.fromkeys(p.name for p in list(self.pipe.started)))

    def errors_logged(self) -> int:
        return self.pipe.log().count("Traceback (most recent call last)")


async def stats(address: str) -> spb.StatsResponse:
    async with aio.insecure_channel(address) as ch:
        return await scheduler_pb2_grpc.SchedulerStub(ch).Stats(spb.StatsRequest(), timeout=10)


async def drained(served: Served, bound_s: float = DRAIN_S) -> spb.StatsResponse | None:
    """The scheduler's stats once nothing runs or waits (and its worker is ready); None if the
    load never drained within the bound (every request still there counts as leaked)."""
    last = None
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        with contextlib.suppress(aio.AioRpcError):
            last = await stats(served.pipe.scheduler_address)
            if last.worker_ready and last.running == 0 and last.waiting == 0:
                return last
        await asyncio.sleep(0.2)
    return None


def leaked_blocks(s: spb.StatsResponse | None) -> int:
    if s is None:
        return -1  # never drained: reported as such
    return s.kv_blocks_used - s.kv_blocks_session_pinned


@contextlib.contextmanager
def serve(log_dir: Path, *flags: str) -> Iterator[Served]:
    log_dir.mkdir(parents=True, exist_ok=True)
    served: Served | None = None
    with pipeline(log_dir, *flags) as pipe:
        served = Served(pipe)
        yield served
    served.shm_after_stop = shm_names_of(served.all_pids())
    served.stuck_on_stop = served.pipe.log().count("did not stop within")
