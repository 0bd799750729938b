"""The deployment under test, seen from outside: its ports, its logs' timeline, its reporting.

Shared by run_compose.py and worker_crash.py: what a check raises (Failure), progress lines, the
addresses the merged compose configuration gives the stages, and waiting with a time box.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import yaml

from tests.deploy.compose_cli import Compose
from tests.deploy.compose_local import DEPLOY

STAGES = ("worker", "scheduler", "tokenizer", "tokenizer-2")
TOKENIZERS = ("tokenizer", "tokenizer-2")


class Failure(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise Failure(message)


class Progress:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[deploy-test {time.monotonic() - self.started:6.1f}s] {message}", flush=True)


say = Progress()


def wait_until(what: str, timeout: float, poll: Callable[[], bool], every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not poll():
        check(time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


@dataclass(frozen=True)
class Ports:
    public: str  # the tokenizers' shared port
    http: str  # the tokenizers' shared OpenAI-compatible HTTP port
    scheduler: str
    worker: str
    own: dict[str, str]  # tokenizer -> the gRPC port of that process alone (--admin-port)
    metrics: dict[str, list[str]]  # Prometheus job -> its targets


def flag(command: list[str], name: str) -> str:
    return str(command[command.index(name) + 1])


def read_ports(compose: Compose) -> Ports:
    """Addresses from the merged configuration Compose will run, and Prometheus' host targets."""
    config = json.loads(compose.run("config", "--format", "json", timeout=60).stdout)
    services = config["services"]
    for name in STAGES:
        check(services[name].get("network_mode") == "host", f"{name} is not on the host network")
    public = {f"127.0.0.1:{flag(services[t]['command'], '--port')}" for t in TOKENIZERS}
    check(len(public) == 1, f"the tokenizers do not share one public port: {public}")
    http = {f"127.0.0.1:{flag(services[t]['command'], '--http-port')}" for t in TOKENIZERS}
    check(len(http) == 1, f"the tokenizers do not share one HTTP port: {http}")
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.host.yml").read_text())
    metrics = {
        job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
        for job in prometheus["scrape_configs"]
    }
    served = sorted(f"127.0.0.1:{flag(services[s]['command'], '--metrics-port')}" for s in STAGES)
    check(
        sorted(t for ts in metrics.values() for t in ts) == served,
        f"prometheus.host.yml scrapes {metrics}, the stages serve {served}",
    )
    return Ports(
        public=public.pop(),
        http=http.pop(),
        scheduler=f"127.0.0.1:{flag(services['scheduler']['command'], '--port')}",
        worker=f"127.0.0.1:{flag(services['worker']['command'], '--port')}",
        own={t: f"127.0.0.1:{flag(services[t]['command'], '--admin-port')}" for t in TOKENIZERS},
        metrics=metrics,
    )


def free_ports(ports: Ports) -> None:
    addresses = [ports.public, ports.http, ports.scheduler, ports.worker, *ports.own.values()]
    addresses += [t for ts in ports.metrics.values() for t in ts]
    for address in addresses:
        host, _, port = address.rpartition(":")
        with socket.socket() as sock:
            # As the servers bind: a connection of an earlier run in TIME_WAIT is no listener.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, int(port)))
            except OSError:
                raise Failure(f"{address} is in use: stop whatever serves there first") from None


# What each stage logs when it reaches a point of its start: (service, the log line's words).
COLD_START_MARKS = {
    "worker process started": ("worker", "tracing to"),
    "worker kernels compiled": ("worker", " ready in "),
    "worker serving": ("worker", "worker serving"),
    "scheduler process started": ("scheduler", "tracing to"),
    "scheduler connected to the worker": ("scheduler", "worker ready"),
    "tokenizers started": ("tokenizer", "tracing to"),
    "tokenizer attached": ("tokenizer", "attached to the scheduler"),
    "tokenizer-2 attached": ("tokenizer-2", "attached to the scheduler"),
}
RESTART_MARKS = {
    "worker process started": ("worker", "tracing to"),
    "worker serving": ("worker", "worker serving"),
    "scheduler connected to the worker": ("scheduler", "worker ready"),
}


def timeline(compose: Compose, since: float, marks: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Seconds from `since` to the first log line of each mark after it (Docker's timestamps)."""
    out = {}
    for what, (service, words) in marks.items():
        logs = compose.run("logs", "--timestamps", "--no-color", service, timeout=60).stdout
        for line in logs.splitlines():
            stamp, _, text = line.partition("|")[2].strip().partition(" ")
            if words in text and stamp and (at := rfc3339(stamp)) >= since:
                out[what] = round(at - since, 1)
                break
    return out


def rfc3339(stamp: str) -> float:
    """Docker's UTC timestamps, with nanoseconds."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp()


def started_at(info: dict[str, Any]) -> float:
    return rfc3339(info["State"]["StartedAt"])
