"""The compose file's stages as local processes: its commands and variables are the ones that work.

No Docker engine runs here, so the worker, scheduler and two tokenizer replicas of
deploy/docker-compose.yml are started on this host as compose_local.py translates them, in the
order their `depends_on` imposes, each awaited on gRPC health. A request streams through each
replica; each process's /metrics is scraped where deploy/prometheus/prometheus.yml says; every
metric the Grafana dashboard queries must be among those scraped; spans reach an OTLP receiver
standing in for Jaeger; each compose health check exits 0; and every process stops on SIGTERM
within its `stop_grace_period`, leaving nothing in /dev/shm.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from harness.pipeline import shm_names_of
from tandem.v1 import generation_pb2 as pb
from tandem.v1 import generation_pb2_grpc
from tests.deploy.compose_local import (
    DEPLOY,
    ROOT,
    LocalStage,
    Translator,
    active_services,
    default_profiles,
    load_compose,
    stage_module,
    start_order,
)
from tests.telemetry.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

TOKENIZER_REPLICAS = 2  # `docker compose up --scale tokenizer=2`
READY_TIMEOUT_S = 180.0
SPAN_WAIT_S = 30.0
TANDEM_METRIC = r"\btandem_[a-z0-9_]+\b"


@dataclass
class Running:
    stage: LocalStage
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


@dataclass
class Stack:
    services: dict[str, Any]
    translator: Translator
    receiver: OtlpReceiver
    log_dir: Path
    running: list[Running] = field(default_factory=list)

    def of(self, service: str) -> list[Running]:
        return [r for r in self.running if r.stage.service == service]

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.running]

    def start(self, stage: LocalStage) -> Running:
        log_path = self.log_dir / f"{stage.instance}.log"
        env = {
            **os.environ,
            **stage.env,
            "PYTHONUNBUFFERED": "1",
            # Export spans within a tenth of a second, not the SDK's 5 s, so the test need not wait.
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                stage.argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        running = Running(stage, proc, log_path)
        self.running.append(running)
        return running

    def stop(self, running: Running) -> int:
        """SIGTERM, as `docker compose stop` sends; SIGKILL after the stop grace period."""
        proc = running.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=running.stage.stop_grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return -signal.SIGKILL
        return proc.returncode

    def stop_all(self) -> dict[str, int]:
        # Compose stops dependents first: the reverse of the start order.
        return {r.stage.instance: self.stop(r) for r in reversed(self.running)}


def wait_serving(running: Running, timeout_s: float) -> None:
    """Until the process's gRPC health says SERVING; fails at once if the process exits."""
    address = f"127.0.0.1:{running.stage.grpc_port}"
    with grpc.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=True
        )

        def cancel_when_dead() -> None:
            running.proc.wait()
            call.cancel()

        threading.Thread(target=cancel_when_dead, daemon=True).start()
        try:
            for reply in call:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError as err:
            if running.proc.poll() is not None:
                raise RuntimeError(
                    f"{running.stage.instance} exited with {running.proc.returncode} while "
                    f"starting:\n{running.log_tail()}"
                ) from None
            raise RuntimeError(
                f"{running.stage.instance} not serving: {err}\n{running.log_tail()}"
            ) from None
        finally:
            call.cancel()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    tandem_home: Path,
    default_gguf: Path,
    receiver: OtlpReceiver,
) -> Iterator[Stack]:
    compose = load_compose()
    services = active_services(compose, default_profiles())
    # The model cache volume is this machine's cache, where `default_gguf` fetched the model.
    translator = Translator(
        services,
        volumes={"models": tandem_home},
        external={"jaeger:4317": f"127.0.0.1:{receiver.port}"},
    )
    stack = Stack(services, translator, receiver, tmp_path_factory.mktemp("compose"))
    stages = [name for name, svc in services.items() if stage_module(svc)]
    try:
        for service in start_order(services, stages):
            replicas = TOKENIZER_REPLICAS if service == "tokenizer" else 1
            started = [
                stack.start(
                    translator.stage(service, f"{service}-{i + 1}" if replicas > 1 else service)
                )
                for i in range(replicas)
            ]
            for running in started:
                wait_serving(running, READY_TIMEOUT_S)
        yield stack
    finally:
        stack.stop_all()
        # Only if a process had to be killed: what it left, and only what it left, goes.
        for name in shm_names_of(stack.pids):
            Path("/dev/shm", name).unlink(missing_ok=True)


@dataclass
class Served:
    text: str = ""
    trace_id: str = ""
    finish_reason: str = ""
    completion_tokens: int = 0


def generate(port: int, prompt: str) -> Served:
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
        max_tokens=8,
        sampling=pb.SamplingParams(temperature=0),
    )
    out = Served()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for reply in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            out.text += reply.text
            out.trace_id = out.trace_id or reply.trace_id
            if reply.finish_reason:
                out.finish_reason = reply.finish_reason
                out.completion_tokens = reply.usage.completion_tokens
    return out


@pytest.fixture(scope="module")
def served(stack: Stack) -> dict[str, Served]:
    return {
        r.stage.instance: generate(r.stage.grpc_port, "Name a colour.")
        for r in stack.of("tokenizer")
    }


@pytest.fixture(scope="module")
def served_http(stack: Stack) -> dict[str, int]:
    """A chat completion through each replica's OpenAI-compatible port: its status."""
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}
    statuses = {}
    for r in stack.of("tokenizer"):
        request = urllib.request.Request(
            f"http://127.0.0.1:{r.stage.http_port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            statuses[r.stage.instance] = reply.status
    return statuses


def scrape(port: int, path: str = "/metrics") -> dict[str, set[str]]:
    """Family name -> the sample names it exported, from one live endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        text = reply.read().decode()
    return {
        family.name: {sample.name for sample in family.samples}
        for family in text_string_to_metric_families(text)
    }


def test_the_stages_start_in_depends_on_order_and_share_dev_shm(stack: Stack) -> None:
    assert [r.stage.service for r in stack.running] == [
        "worker",
        "scheduler",
        *["tokenizer"] * TOKENIZER_REPLICAS,
    ]
    # With `--transport shm` every tokenizer's prompt arena, and the scheduler's rings, live in
    # the one /dev/shm that the stages share (the host's here, the `shm` container's in compose).
    for service in ("tokenizer", "scheduler"):
        for running in stack.of(service):
            assert shm_names_of([running.proc.pid]), f"{running.stage.instance} has no segment"


def test_a_request_streams_through_every_tokenizer_replica(served: dict[str, Served]) -> None:
    assert len(served) == TOKENIZER_REPLICAS
    for instance, got in served.items():
        assert got.text.strip(), instance
        assert got.finish_reason in ("stop", "length") and 0 < got.completion_tokens <= 8
        assert len(got.trace_id) == 32


def test_each_compose_health_check_passes(stack: Stack) -> None:
    for running in stack.running:
        done = subprocess.run(
            running.stage.health_argv,
            cwd=ROOT,
            env={**os.environ, **running.stage.env},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, f"{running.stage.instance}: {done.stderr}"
        assert "SERVING" in done.stdout


def test_prometheus_scrapes_the_port_every_process_serves(
    stack: Stack, served: dict[str, Served]
) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    scraped: set[str] = set()
    for job in config["scrape_configs"]:
        targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        for sd in job.get("dns_sd_configs", []):
            targets += [f"{name}:{sd['port']}" for name in sd["names"]]
        for target in targets:
            host, _, port = target.rpartition(":")
            service = stack.translator.names.get(host)
            assert service is not None, f"{job['job_name']} scrapes {target}: no such service"
            if service not in {r.stage.service for r in stack.running}:
                continue  # Envoy: tests/deploy/test_manifests.py checks its admin port
            for running in stack.of(service):
                local = stack.translator.ports.known(running.stage.instance, int(port))
                assert local == running.stage.metrics_port != 0, (
                    f"{job['job_name']} scrapes {target}, but {running.stage.instance} serves "
                    f"/metrics on {running.stage.container_metrics_port}"
                )
                families = scrape(local, job.get("metrics_path", "/metrics"))
                assert any(name.startswith("tandem_") for name in families), target
                scraped.add(running.stage.instance)
    assert scraped == {r.stage.instance for r in stack.running}


def test_the_dashboard_queries_only_metrics_the_processes_export(
    stack: Stack, served: dict[str, Served], served_http: dict[str, int]
) -> None:
    assert set(served_http.values()) == {200}
    exported: set[str] = set()
    for running in stack.running:
        for samples in scrape(running.stage.metrics_port).values():
            exported |= samples
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tandem.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"]]
    named = {m for q in queries for m in re.findall(TANDEM_METRIC, q)}
    assert named, "the dashboard queries no tandem metric"
    assert named <= exported, f"not exported by any process: {sorted(named - exported)}"
    wanted = {  # the panels: TTFT, ITL, throughput, queue, KV usage, batch size
        "tandem_time_to_first_token_seconds_bucket",
        "tandem_inter_token_latency_seconds_bucket",
        "tandem_generation_tokens_total",
        "tandem_num_requests_waiting",
        "tandem_kv_cache_usage_perc",
        "tandem_step_batch_size_bucket",
        "tandem_http_requests_total",  # and what the HTTP door refused
    }
    assert wanted <= named


def test_spans_of_every_stage_reach_the_otlp_endpoint(
    stack: Stack, served: dict[str, Served]
) -> None:
    trace_ids = {got.trace_id for got in served.values()}

    def complete(spans: list[ReceivedSpan]) -> bool:
        services = {s.service for s in spans if s.trace_id in trace_ids}
        rooted = {s.trace_id for s in spans if s.name == "Generate"}
        stages = {"tandem-tokenizer", "tandem-scheduler", "tandem-worker"}
        return services >= stages and rooted >= trace_ids

    spans = stack.receiver.wait_for(complete, SPAN_WAIT_S)
    roots = [s for s in spans if s.name == "Generate" and s.trace_id in trace_ids]
    assert {s.trace_id for s in roots} == trace_ids
    assert {s.service for s in roots} == {"tandem-tokenizer"}


def test_every_stage_stops_within_its_grace_period_and_leaves_no_shared_memory(
    stack: Stack, served: dict[str, Served]
) -> None:
    pids = stack.pids
    codes = stack.stop_all()
    assert codes == {r.stage.instance: 0 for r in stack.running}, codes
    assert shm_names_of(pids) == []
