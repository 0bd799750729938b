"""A worker crash inside its container, and what must follow it (a crash, not a stop).

SIGKILL to the worker's `python` (not `docker compose kill`, which Docker takes for a manual stop
and does not restart) during a stream.

Whose segment is whose: every stage is PID 7 or 8 of its own PID namespace, so the PIDs in
segment names repeat across containers. Liveness never reads them (a segment's owner holds an
flock on it: shm/segment.py), and neither does this step: /proc/locks in a container lists only
the locks of that container's processes, so what a stage holds is read in its own container
(shm_probe.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.internal.v1 import scheduler_pb2_grpc
from tests.deploy.compose_cli import Compose, now
from tests.deploy.live_stack import (
    RESTART_MARKS,
    STAGES,
    TOKENIZERS,
    Ports,
    check,
    say,
    started_at,
    timeline,
    wait_until,
)
from tests.deploy.streams import REQUEST_TIMEOUT_S, Stream, generate, request

PROBE = (Path(__file__).parent / "shm_probe.py").read_text()
RECOVERY_TIMEOUT_S = 300


def probe(compose: Compose, service: str, *args: str) -> dict[str, Any]:
    return dict(compose.python(service, PROBE, *args, may_die=args[:1] == ("kill",)))


def segments(names: Iterable[str]) -> set[str]:
    return {n for n in names if not n.startswith("sem.")}


def with_semaphores(names: set[str]) -> set[str]:
    return names | {f"sem.{n}.{end}" for n in names for end in ("data", "space")}


def crash_the_worker(compose: Compose, ports: Ports, results: dict[str, Any]) -> None:
    before = {s: probe(compose, s) for s in STAGES}
    check(all(e["alive"] for e in before["scheduler"]["entries"]), "a dead segment before the kill")
    held = {s: segments(p["held"]) for s, p in before.items()}
    check(all(held.values()), f"a stage owns no segment: {held}")
    all_held = [n for names in held.values() for n in names]
    check(len(all_held) == len(set(all_held)), f"two stages hold one segment: {held}")
    namespaces = {p["pid_ns"] for p in before.values()}
    check(len(namespaces) == len(STAGES), "the stages do not have PID namespaces of their own")
    pids = sorted({n.split("-")[1] for n in all_held})
    say(
        f"before the kill: {len(all_held)} segments, each held by one stage in its own PID "
        f"namespace (names carry PIDs {', '.join(pids)}): "
        + "; ".join(f"{s}: {sorted(h)}" for s, h in held.items())
    )
    others_before = {s: compose.inspect(s) for s in STAGES}

    long = request("text", "Tell me a long story about shared memory.", max_tokens=1000)
    long.ignore_eos = True
    stream = Stream(ports.public, long, wanted_replies=4).start()
    check(
        stream.progressed.wait(REQUEST_TIMEOUT_S) and stream.error is None,
        f"the long stream did not start: {stream.status()}",
    )
    killed = probe(compose, "worker", "kill", "services.worker")
    killed_at = killed["killed_at"]
    say(
        f"SIGKILL to the worker's python (PID {killed['killed']} in its container) after "
        f"{stream.replies} replies of a stream"
    )

    stream.wait()
    check(stream.error is not None, "the stream went on after the worker was killed")
    code = stream.error.code()  # type: ignore[attr-defined]
    check(code == grpc.StatusCode.UNAVAILABLE, f"the stream ended {stream.status()}")
    check("worker" in stream.status(), f"the error does not name the worker: {stream.status()}")
    results["kill_to_unavailable_s"] = round(stream.ended_at - killed_at, 2)
    say(f"the stream ended {results['kill_to_unavailable_s']} s later: {stream.status()}")

    # The reaper's view from another PID namespace: the dead worker's segments and nothing else.
    # The scheduler closes its step ring itself when it loses the worker (a new worker gets a
    # new one), so that one may be gone; the tokenizers' segments, and the scheduler's event
    # rings to them, must stay, alive.
    worker_owned = held["worker"]
    step_ring = {n[4 : -len(".space")] for n in before["worker"]["held"] if n.startswith("sem.")}
    staying = (held["scheduler"] - step_ring) | held["tokenizer"] | held["tokenizer-2"]
    crash = probe(compose, "tokenizer")
    dead = {e["name"] for e in crash["entries"] if not e["alive"]}
    alive = {e["name"] for e in crash["entries"] if e["alive"]}
    check(dead <= with_semaphores(worker_owned), f"dead beyond the worker's: {dead}")
    check(not (worker_owned & alive), "the killed worker's segments look alive")
    check(staying <= alive, f"not alive after the kill: {sorted(staying - alive)}")
    say(
        f"just after the kill, seen from the tokenizer's namespace: dead {sorted(dead)}; "
        f"alive {sorted(alive)}"
    )

    errors: dict[str, int] = {}

    def served() -> bool:
        got = generate(ports.public, request("text", "Back?", max_tokens=4))
        if got.error is not None:  # counted by message, "lost 3 s ago" as "lost N s ago"
            status = re.sub(r"lost \d+ s ago", "lost N s ago", got.status())
            errors[status] = errors.get(status, 0) + 1
        return got.error is None

    wait_until("a request served after the kill", RECOVERY_TIMEOUT_S, served)
    results["kill_to_first_success_s"] = round(now() - killed_at, 1)
    results["errors_while_down"] = errors
    say(f"served again {results['kill_to_first_success_s']} s after the kill; meanwhile {errors}")

    worker = compose.inspect("worker")
    check(worker["RestartCount"] == 1, f"worker RestartCount {worker['RestartCount']}, not 1")
    results["kill_to_container_start_s"] = round(started_at(worker) - killed_at, 1)
    wait_until(
        "the restarted worker's health check",
        120,
        lambda: compose.inspect("worker")["State"]["Health"]["Status"] == "healthy",
    )
    results["kill_to_healthy_s"] = round(now() - killed_at, 1)
    results["restart_timeline_s"] = timeline(compose, killed_at, RESTART_MARKS)
    for stage in ("scheduler", *TOKENIZERS):
        info = compose.inspect(stage)
        check(
            info["RestartCount"] == 0
            and info["State"]["StartedAt"] == others_before[stage]["State"]["StartedAt"],
            f"{stage} restarted too",
        )
    with grpc.insecure_channel(ports.scheduler) as channel:
        stats = scheduler_pb2_grpc.SchedulerStub(channel).Stats(spb.StatsRequest(), timeout=10)
    check(stats.worker_ready and stats.worker_restarts == 1, f"scheduler stats: {stats}")
    say(
        f"the restart policy started the worker's container "
        f"{results['kill_to_container_start_s']} s after the kill; healthy after "
        f"{results['kill_to_healthy_s']} s; the scheduler counts 1 worker restart; "
        f"s after the kill: {results['restart_timeline_s']}"
    )

    after = {s: probe(compose, s) for s in STAGES}
    entries = after["scheduler"]["entries"]
    names = {e["name"] for e in entries}
    check(not (with_semaphores(worker_owned) & names), f"not reaped: {worker_owned & names}")
    dead_left = [e["name"] for e in entries if not e["alive"]]
    check(not dead_left, f"dead entries left: {dead_left}")
    for stage in ("scheduler", *TOKENIZERS):
        lost = (held[stage] & staying) - segments(after[stage]["held"])
        check(not lost, f"{stage} no longer holds {sorted(lost)}")
    new_worker = segments(after["worker"]["held"])
    check(bool(new_worker) and not (new_worker & worker_owned), "the new worker holds no new ring")
    say(
        f"after recovery: the dead worker's {sorted(worker_owned)} reaped; the tokenizers' and "
        f"the scheduler's event rings still held by them; new rings: worker "
        f"{sorted(new_worker)}, scheduler {sorted(segments(after['scheduler']['held']) - staying)};"
        f" every entry alive"
    )
