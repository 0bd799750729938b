"""`make deploy-test`: the compose deployment for real, on this host's network, end to end.

    python -m tests.deploy.run_compose [--docker /usr/bin/docker] [--image tandem:cpu]

With the image built (`make image`), it brings up the shm holder, the worker, the scheduler and
two tokenizers from docker-compose.yml + docker-compose.host.yml under a project of its own and
waits on their health checks, then:

1. streams requests through the public port and each tokenizer's own port, and checks their
   text and token ids against `tandem run` in the worker's container (the same image and CPU);
2. scrapes every /metrics that prometheus/prometheus.host.yml names;
3. waits until one request's spans from all three stages reach an OTLP receiver of its own;
4. kills the worker's process (SIGKILL, inside its container) during a stream: the stream must
   end UNAVAILABLE, the restart policy bring the container back, the next request succeed, the
   dead worker's segments be reaped and no live stage's (owners told by /proc/locks, below);
5. stops the stages (each must exit 0 on SIGTERM), checks inside the IPC namespace that no
   tandem segment is left, and `docker compose down`s: no container, no volume left.

Whatever happens, the project is brought down. Exit status 0 only if every check held; the
measurements (cold start, kill to recovery, image size) are printed and written to
out/deploy-test.json.

Whose segment is whose: every stage is PID 7 or 8 of its own PID namespace, so the PIDs in
segment names repeat across containers. Liveness never reads them (a segment's owner holds an
flock on it: shm/segment.py), and neither does this test: /proc/locks in a container lists only
the locks of that container's processes, so what a stage holds is read in its own container
(shm_probe.py).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tandem.internal.v1 import scheduler_pb2 as spb
from tandem.internal.v1 import scheduler_pb2_grpc
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.deploy.compose_cli import CommandFailed, Compose, image_layers, now
from tests.deploy.compose_local import DEPLOY, ROOT
from tests.telemetry.otlp_receiver import OtlpReceiver, ReceivedSpan

PROJECT = "tandem-deploy-test"
STAGES = ("worker", "scheduler", "tokenizer", "tokenizer-2")
TOKENIZERS = ("tokenizer", "tokenizer-2")
PROBE = (Path(__file__).parent / "shm_probe.py").read_text()
PROMPTS = (("text", "The capital of France is"), ("chat", "Name a famous bridge in San Francisco."))
MAX_TOKENS = 24
UP_TIMEOUT_S = 600  # a cold start compiles the worker's CPU kernels
REQUEST_TIMEOUT_S = 120
SPAN_WAIT_S = 60
RECOVERY_TIMEOUT_S = 300
RESULTS = ROOT / "out" / "deploy-test.json"


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


# The host override, read back


@dataclass(frozen=True)
class Ports:
    public: str  # the tokenizers' shared port
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
        scheduler=f"127.0.0.1:{flag(services['scheduler']['command'], '--port')}",
        worker=f"127.0.0.1:{flag(services['worker']['command'], '--port')}",
        own={t: f"127.0.0.1:{flag(services[t]['command'], '--admin-port')}" for t in TOKENIZERS},
        metrics=metrics,
    )


# Requests


def request(kind: str, prompt: str, max_tokens: int = MAX_TOKENS, **kw: Any) -> pb.GenerateRequest:
    out = pb.GenerateRequest(max_tokens=max_tokens, sampling=pb.SamplingParams(temperature=0), **kw)
    if kind == "chat":
        out.chat.messages.add(role="user", content=prompt)
    else:
        out.text = prompt
    return out


@dataclass
class Stream:
    """One Generate call, consumed on a thread: what arrived, when, and how it ended."""

    address: str
    request: pb.GenerateRequest
    replies: int = 0
    first_token_at: float = 0.0
    trace_id: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    error: grpc.RpcError | None = None
    ended_at: float = 0.0
    progressed: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    wanted_replies: int = 1

    def start(self) -> Stream:
        threading.Thread(target=self._consume, daemon=True).start()
        return self

    def _consume(self) -> None:
        try:
            with grpc.insecure_channel(self.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for reply in stub.Generate(self.request, timeout=REQUEST_TIMEOUT_S):
                    self.replies += 1
                    self.trace_id = self.trace_id or reply.trace_id
                    self.prompt_ids.extend(reply.prompt_token_ids)
                    if reply.token_ids and not self.first_token_at:
                        self.first_token_at = now()
                    self.token_ids.extend(reply.token_ids)
                    self.text += reply.text
                    self.finish_reason = reply.finish_reason or self.finish_reason
                    if self.replies >= self.wanted_replies:
                        self.progressed.set()
        except grpc.RpcError as err:
            self.error = err
        finally:
            self.ended_at = now()
            self.progressed.set()
            self.done.set()

    def wait(self, timeout: float = REQUEST_TIMEOUT_S + 10) -> Stream:
        check(self.done.wait(timeout), f"a stream from {self.address} did not end in {timeout} s")
        return self

    def status(self) -> str:
        if self.error is None:
            return "OK"
        return f"{self.error.code().name}: {self.error.details()}"  # type: ignore[attr-defined]


def generate(address: str, req: pb.GenerateRequest) -> Stream:
    return Stream(address, req).start().wait()


# Checks


def bring_up(compose: Compose, results: dict[str, Any]) -> None:
    say("docker compose up: shm holder, worker, scheduler, two tokenizers (host network)")
    started = now()
    compose.stream(
        "up",
        "-d",
        "--no-build",
        "--wait",
        "--wait-timeout",
        str(UP_TIMEOUT_S),
        "shm",
        *STAGES,
        timeout=UP_TIMEOUT_S + 60,
    )
    results["cold_start_to_healthy_s"] = round(now() - started, 1)
    results["cold_start_started_at"] = started
    say(f"all healthy {results['cold_start_to_healthy_s']} s after `up`")


def first_token(ports: Ports, results: dict[str, Any]) -> None:
    got = generate(ports.public, request("chat", "Hello!", max_tokens=8))
    check(got.error is None and got.first_token_at > 0, f"the first request failed: {got.status()}")
    results["cold_start_to_first_token_s"] = round(
        got.first_token_at - results.pop("cold_start_started_at"), 1
    )
    say(f"first token {results['cold_start_to_first_token_s']} s after `up`: {got.text!r}")


def check_text(compose: Compose, ports: Ports) -> str:
    """Each prompt's streamed text equals `tandem run`'s; returns one request's trace id."""
    trace_id = ""
    for kind, prompt in PROMPTS:
        argv = ["--chat"] if kind == "chat" else []
        done = compose.run(
            "exec",
            "-T",
            "worker",
            "tandem",
            "run",
            "--json",
            *argv,
            "--prompt",
            prompt,
            "--max-tokens",
            str(MAX_TOKENS),
            timeout=180,
        )
        want = json.loads(done.stdout.strip().splitlines()[-1])
        addresses = {"public port": ports.public, **ports.own}
        for where, address in addresses.items():
            got = generate(address, request(kind, prompt))
            check(got.error is None, f"{kind} prompt through {where}: {got.status()}")
            check(got.prompt_ids == want["prompt_token_ids"], f"{kind} prompt ids differ ({where})")
            check(
                got.token_ids == want["token_ids"] and got.text == want["text"],
                f"{kind} prompt through {where}: {got.text!r}, tandem run: {want['text']!r}",
            )
            check(got.finish_reason == want["finish_reason"], f"finish reason differs ({where})")
            trace_id = trace_id or got.trace_id
        say(
            f"{kind} prompt: the same {len(want['token_ids'])} tokens as `tandem run` "
            f"through {', '.join(addresses)}: {want['text']!r}"
        )
    return trace_id


def scrape(target: str) -> dict[str, float]:
    """Sample name -> its value summed over labels, from one live /metrics."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def check_metrics(ports: Ports) -> None:
    # Both tokenizers served requests above, and every request ran steps.
    served_something = {
        "tandem-tokenizer": "tandem_request_success_total",
        "tandem-scheduler": "tandem_scheduler_steps_total",
        "tandem-worker": "tandem_step_duration_seconds_count",
    }
    for job, targets in ports.metrics.items():
        for target in targets:
            samples = scrape(target)
            check(any(n.startswith("tandem_") for n in samples), f"{target}: no tandem_ metric")
            wanted = served_something[job]
            check(samples.get(wanted, 0) > 0, f"{target}: {wanted} is 0")
    say(
        f"metrics: {sum(len(t) for t in ports.metrics.values())} endpoints scraped: "
        f"{', '.join(t for ts in ports.metrics.values() for t in ts)}"
    )


def check_traces(receiver: OtlpReceiver, trace_id: str) -> None:
    wanted = {"tandem-tokenizer", "tandem-scheduler", "tandem-worker"}

    def complete(spans: list[ReceivedSpan]) -> bool:
        return wanted <= {s.service for s in spans if s.trace_id == trace_id}

    spans = receiver.wait_for(complete, SPAN_WAIT_S)
    mine = sorted({(s.service, s.name) for s in spans if s.trace_id == trace_id})
    say(f"trace {trace_id}: {len(mine)} kinds of span from three containers: {mine}")


def probe(compose: Compose, service: str, *args: str) -> dict[str, Any]:
    return dict(compose.python(service, PROBE, *args))


def segments(names: Iterable[str]) -> set[str]:
    return {n for n in names if not n.startswith("sem.")}


def with_semaphores(names: set[str]) -> set[str]:
    return names | {f"sem.{n}.{end}" for n in names for end in ("data", "space")}


def started_at(info: dict[str, Any]) -> float:
    stamp = info["State"]["StartedAt"]  # RFC 3339 with nanoseconds
    head, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp()


def wait_until(what: str, timeout: float, poll: Callable[[], bool], every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not poll():
        check(time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


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
        if got.error is not None:
            errors[got.status()] = errors.get(got.status(), 0) + 1
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
        f"{results['kill_to_healthy_s']} s; the scheduler counts 1 worker restart"
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


def stop_and_down(compose: Compose) -> None:
    compose.run("stop", *STAGES, timeout=180)
    codes = {s: compose.inspect(s)["State"]["ExitCode"] for s in STAGES}
    check(all(code == 0 for code in codes.values()), f"exit codes on SIGTERM: {codes}")
    left = compose.run("exec", "-T", "shm", "ls", "-a", "/dev/shm", timeout=30).stdout.split()
    ours = [n for n in left if n.startswith(("tandem-", "sem.tandem-"))]
    check(not ours, f"left in the IPC namespace after the stages stopped: {ours}")
    say(f"stages stopped on SIGTERM, exit codes {codes}; /dev/shm of the IPC namespace: {left}")
    compose.down()
    check(not compose.containers(), f"containers left: {compose.containers()}")
    check(not compose.volumes(), f"volumes left: {compose.volumes()}")
    say("docker compose down: no container and no volume of the project left")


def free_ports(ports: Ports) -> None:
    addresses = [ports.public, ports.scheduler, ports.worker, *ports.own.values()]
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


def run(compose: Compose, receiver: OtlpReceiver, image: str, results: dict[str, Any]) -> None:
    size, layers = image_layers(compose.docker, image)
    results["image"] = {"name": image, "bytes": size, "layers": layers}
    say(f"image {image}: {size / 1e9:.2f} GB")
    compose.down()  # whatever an interrupted earlier run of this test left
    ports = read_ports(compose)
    free_ports(ports)
    bring_up(compose, results)
    first_token(ports, results)
    trace_id = check_text(compose, ports)
    check_metrics(ports)
    check_traces(receiver, trace_id)
    crash_the_worker(compose, ports, results)
    stop_and_down(compose)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.deploy.run_compose", description=__doc__)
    parser.add_argument("--docker", default="docker", help="the docker CLI (here /usr/bin/docker)")
    parser.add_argument("--image", default="tandem:cpu", help="the CPU image, built beforehand")
    args = parser.parse_args(argv)
    receiver = OtlpReceiver().start()
    compose = Compose(
        args.docker,
        PROJECT,
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "TANDEM_IMAGE": args.image},
    )
    results: dict[str, Any] = {}
    failed = False
    try:
        run(compose, receiver, args.image, results)
    except Exception as err:  # any failure: report it, then bring the project down
        failed = True
        print(f"\nFAILED: {err}", file=sys.stderr, flush=True)
        traceback.print_exc()
        print(compose.logs(STAGES), file=sys.stderr)
    finally:
        try:
            compose.down()
        except CommandFailed as err:
            failed = True
            print(f"FAILED to bring the project down: {err}", file=sys.stderr)
        receiver.stop()
    results["passed"] = not failed
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    summary = {k: v for k, v in results.items() if k != "image"}
    say(f"{'PASSED' if not failed else 'FAILED'}: {json.dumps(summary)} (all in {RESULTS})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
