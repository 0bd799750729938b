"""`tandem serve` as a real subprocess, for end-to-end tests and benchmarks.

Free ports are picked per pipeline, the environment is copied (never mutated; `env` adds to the
copy), readiness is the launcher's "tandem serving" line, and a launcher that exits while
starting fails the test at once with the tail of its log. The lines before it name each
process's metrics endpoint.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from services.launcher import free_port

READY_TIMEOUT_S = 240.0


@dataclass
class Pipeline:
    address: str
    scheduler_address: str
    worker_address: str
    proc: subprocess.Popen[str]
    log_path: Path
    # Process name ("worker", "scheduler", "tokenizer-1", ...) -> its /metrics URL.
    metrics: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, list[int]]:
        pids: dict[str, list[int]] = {}
        for name, pid in re.findall(r"started (\S+) \(pid (\d+)\)", self.log()):
            pids.setdefault(name, []).append(int(pid))
        return pids


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
    log_dir: Path, *flags: str, env: Mapping[str, str] | None = None
) -> Iterator[Pipeline]:
    port, sched, worker = free_port(), free_port(), free_port()
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
        *flags,
    ]
    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=child_env)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout or ():
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    running = Pipeline(
        f"127.0.0.1:{port}", f"127.0.0.1:{sched}", f"127.0.0.1:{worker}", proc, log_path
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(
                    f"pipeline not ready in {READY_TIMEOUT_S} s:\n{running.log()[-3000:]}"
                ) from None
            if line is None:
                raise RuntimeError(
                    f"tandem serve exited with {proc.wait()}:\n{running.log()[-3000:]}"
                )
            if line.startswith("tandem serving"):
                break
            if line.startswith("metrics "):
                _, name, url = line.split()
                running.metrics[name] = url
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
