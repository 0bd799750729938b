"""`tandem serve` as a real subprocess, for end-to-end tests and benchmarks.

Free ports are picked per pipeline (a launch that finds one taken starts over on new ones), the
environment is copied (never mutated; `env` adds to the copy), readiness is the launcher's
"tandem serving" line, and a launcher that exits while starting fails at once with the tail of
its log. The launcher's log is read as it is written: each "started NAME (pid N) at ADDRESS"
line records a process (and calls `on_started[NAME]`, which is how a test kills a process at a
chosen moment of the start-up).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from services.launcher import free_port

READY_TIMEOUT_S = 240.0
# A port picked free (here, or by the launcher for its children) may be taken by another process
# before the one it is meant for binds it: a launch that fails to bind starts over on new ports.
LAUNCH_ATTEMPTS = 3
# gRPC's words, the launcher's, the OS's, and ours (services.listen) for a port that was taken.
BIND_FAILED = re.compile(
    r"failed to bind|could not bind|address already in use|port is in use|though it is free now",
    re.IGNORECASE,
)
_STARTED = re.compile(r"started (\S+) \(pid (\d+)\) at (\S+)")


class PortTaken(RuntimeError):
    """tandem serve exited while starting because a port it was given was no longer free."""


@dataclass
class Process:
    name: str  # "worker", "scheduler", "tokenizer-1", ...
    pid: int
    address: str  # its own gRPC port (health; a tokenizer serves the public API there too)


@dataclass
class Pipeline:
    address: str
    scheduler_address: str
    worker_address: str
    proc: subprocess.Popen[str]
    log_path: Path
    # Process name -> its /metrics URL.
    metrics: dict[str, str] = field(default_factory=dict)
    # Every process the launcher started, restarts included, in order.
    started: list[Process] = field(default_factory=list)
    # The OpenAI-compatible API's base URL (scheme://host:port/v1); empty with --http-port 0.
    http_url: str = ""

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, list[int]]:
        pids: dict[str, list[int]] = {}
        for p in list(self.started):
            pids.setdefault(p.name, []).append(p.pid)
        return pids

    def latest(self, name: str) -> Process:
        return next(p for p in reversed(list(self.started)) if p.name == name)

    def kill(self, name: str) -> int:
        """SIGKILL the newest process of that name; returns its pid."""
        pid = self.latest(name).pid
        os.kill(pid, signal.SIGKILL)
        return pid


def shm_names_of(pids: list[int]) -> list[str]:
    """Our segments in /dev/shm created by these processes (names are tandem-<pid>-<random>)."""
    wanted = {str(p) for p in pids}
    return [
        n
        for n in os.listdir("/dev/shm")
        if "tandem-" in n and n.split("tandem-")[1].split("-")[0] in wanted
    ]


@contextmanager
def pipeline(
    log_dir: Path,
    *flags: str,
    env: Mapping[str, str] | None = None,
    on_started: Mapping[str, Callable[[Pipeline], None]] | None = None,
) -> Iterator[Pipeline]:
    for attempt in range(1, LAUNCH_ATTEMPTS + 1):
        try:
            running = _launch(log_dir, flags, env, on_started)
            break
        except PortTaken:
            if attempt == LAUNCH_ATTEMPTS:
                raise
    try:
        yield running
    except BaseException:
        # pytest shows captured stderr with the failure: what the processes said is there.
        sys.stderr.write(f"--- tandem serve's log ({running.log_path}), last lines ---\n")
        sys.stderr.write(running.log()[-12000:])
        raise
    finally:
        _stop(running.proc)


def _launch(
    log_dir: Path,
    flags: tuple[str, ...],
    env: Mapping[str, str] | None,
    on_started: Mapping[str, Callable[[Pipeline], None]] | None,
) -> Pipeline:
    """`tandem serve` on new ports, once it is serving; stopped again if it never gets there."""
    picked: set[int] = set()
    while len(picked) < 4:  # the OS may return a port again once it is closed
        picked.add(free_port())
    port, sched, worker, http_port = picked
    http = [] if "--http-port" in flags else ["--http-port", str(http_port)]
    log_path = log_dir / f"serve-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "serve",
        "--port",
        str(port),
        "--scheduler-port",
        str(sched),
        "--worker-port",
        str(worker),
        *http,
        *flags,
    ]
    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env
    )
    running = Pipeline(
        f"127.0.0.1:{port}", f"127.0.0.1:{sched}", f"127.0.0.1:{worker}", proc, log_path
    )
    hooks = dict(on_started or {})

    def pump_log() -> None:
        with log_path.open("w") as log:
            for line in proc.stderr or ():
                log.write(line)
                log.flush()
                if match := _STARTED.search(line):
                    running.started.append(Process(match[1], int(match[2]), match[3]))
                    hook = hooks.pop(match[1], None)
                    if hook is not None:
                        hook(running)

    lines: queue.Queue[str | None] = queue.Queue()

    def pump_stdout() -> None:
        for line in proc.stdout or ():
            lines.put(line)
        lines.put(None)

    log_pump = threading.Thread(target=pump_log, daemon=True)
    log_pump.start()
    threading.Thread(target=pump_stdout, daemon=True).start()
    try:
        while True:
            try:
                line = lines.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(
                    f"pipeline not ready in {READY_TIMEOUT_S} s:\n{running.log()[-3000:]}"
                ) from None
            if line is None:
                code = proc.wait()
                log_pump.join(timeout=60)  # the whole log: it says why
                failed = PortTaken if BIND_FAILED.search(running.log()) else RuntimeError
                raise failed(f"tandem serve exited with {code}:\n{running.log()[-3000:]}")
            if line.startswith("tandem serving"):
                break
            if line.startswith("metrics "):
                _, name, url = line.split()
                running.metrics[name] = url
            if line.startswith("http "):
                running.http_url = line.split()[1]
    except BaseException:
        _stop(proc)
        raise
    return running


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
