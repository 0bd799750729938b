"""deploy/ against its schemas and against itself, offline: what can be proven without Docker.

The compose file validates against the compose specification (check-jsonschema's vendored
schema) and the Kubernetes manifests against the API's (kubernetes-validate's bundled schemas,
strict: an unknown field fails); each validator is shown to reject a broken copy, so a pass is
not a validator that checks nothing. Then the pieces that name each other agree: ports, hosts,
volumes, profiles, shared memory, probes, Envoy's upstream, Prometheus' Envoy target, Grafana's
datasource, the Dockerfiles' build steps, and every stage command parses with the real flags of
its process (the GPU worker's and the manifests' too, which no test here can run).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import healthcheck
from services.launcher import free_port
from services.scheduler.config import BACKLOG_ON_CUDA
from tests.deploy.compose_local import (
    COMPOSE_FILE,
    DEPLOY,
    ROOT,
    load_compose,
    read_dotenv,
    stage_module,
)

K8S = DEPLOY / "k8s"
# gRPC probes (`grpc:`) are GA from 1.27; the newest the validator knows is checked too.
K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
SHM_HOLDER = "shm"
STAGES = ("tokenizer", "scheduler", "worker", "worker-gpu")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def flag(command: list[Any], name: str) -> str:
    command = [str(a) for a in command]
    return command[command.index(name) + 1]


def default_of(value: str) -> int:
    """The number a compose value `${NAME:-N}` (or a plain N) stands for when NAME is unset."""
    return int(value.rsplit(":-", 1)[-1].rstrip("}"))


def k8s_documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in yaml.safe_load_all(path.read_text()):
                yield path, doc


def k8s_kind(kind: str, name: str) -> dict[str, Any]:
    for _, doc in k8s_documents():
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise KeyError(f"no {kind} {name} in deploy/k8s")


def containers_of(name: str) -> dict[str, dict[str, Any]]:
    spec = k8s_kind("Deployment", name)["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["containers"]}


def check_jsonschema(path: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec"]
    return subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=120)


# Schemas


def test_the_compose_file_validates_against_the_compose_specification(tmp_path: Path) -> None:
    done = check_jsonschema(COMPOSE_FILE)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("    ipc: shareable", "    ipc_mode: 1"))
    assert check_jsonschema(broken).returncode != 0


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_kubernetes_manifests_validate_against_their_schemas(version: str) -> None:
    documents = list(k8s_documents())
    assert {doc["kind"] for _, doc in documents} >= {
        "Deployment",
        "Service",
        "ConfigMap",
        "HorizontalPodAutoscaler",
    }
    for path, doc in documents:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{path.name}: {doc['kind']} {doc['metadata']['name']}: {err.message}")
    broken = dict(k8s_kind("Deployment", "tandem-engine"), replica=2)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files


# The compose file


def test_the_stages_share_one_ipc_namespace_owned_by_a_holder_that_never_restarts(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    holder = services[SHM_HOLDER]
    assert holder["ipc"] == "shareable"
    size = re.fullmatch(r"(\d+)(gb|g|mb|m)", str(holder["shm_size"]).lower())
    assert size is not None, holder["shm_size"]
    mib = int(size[1]) * (1024 if size[2].startswith("g") else 1)
    # One tokenizer's 64 MiB prompt arena and 8 MiB event ring, the 16 MiB step ring and the
    # worker's 8 MiB result ring already pass Docker's 64 MiB default.
    assert mib >= 512
    for name in STAGES:
        assert services[name]["ipc"] == f"service:{SHM_HOLDER}", name
        assert services[name]["depends_on"][SHM_HOLDER]["condition"] == "service_started"


def test_every_stage_restarts_and_is_health_checked_on_its_own_grpc_port(
    compose: dict[str, Any],
) -> None:
    for name in STAGES:
        svc = compose["services"][name]
        assert stage_module(svc) == f"services.{name.removesuffix('-gpu')}"
        assert svc["restart"] == "unless-stopped"
        port = flag(svc["command"], "--port")
        assert svc["healthcheck"]["test"] == [
            "CMD",
            "python",
            "-m",
            "services.healthcheck",
            f"127.0.0.1:{port}",
        ]
        assert flag(svc["command"], "--host") == flag(svc["command"], "--metrics-host")


def test_start_order_follows_health(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["tokenizer"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    for worker in ("worker", "worker-gpu"):
        dep = services["scheduler"]["depends_on"][worker]
        # Only the active profile's worker exists; the scheduler waits for whichever it is.
        assert dep == {"condition": "service_healthy", "required": False}
    assert services["envoy"]["depends_on"]["tokenizer"]["condition"] == "service_healthy"


def test_the_cpu_worker_by_default_and_the_gpu_worker_in_its_profile(
    compose: dict[str, Any],
) -> None:
    cpu, gpu = compose["services"]["worker"], compose["services"]["worker-gpu"]
    assert read_dotenv()["COMPOSE_PROFILES"] == "cpu"
    assert cpu["profiles"] == ["cpu"] and gpu["profiles"] == ["gpu"]
    assert gpu["networks"]["default"]["aliases"] == ["worker"]
    for name in ("--port", "--metrics-port"):
        assert flag(cpu["command"], name) == flag(gpu["command"], name)
    assert flag(cpu["command"], "--device") == "cpu"
    assert flag(gpu["command"], "--device") == "cuda"
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert gpu["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    assert cpu["build"]["dockerfile"] == "deploy/Dockerfile"
    scheduler = compose["services"]["scheduler"]["command"]
    assert "worker:" + flag(cpu["command"], "--port") == flag(scheduler, "--worker")
    for worker in (cpu, gpu):  # the worker sizes its buffers and warm-up for the scheduler's
        assert flag(worker["command"], "--max-num-seqs") == flag(scheduler, "--max-num-seqs")
    # The largest step: the scheduler's budget on a CPU, a backlog's on CUDA (by default).
    budget = flag(scheduler, "--max-num-batched-tokens")
    assert flag(cpu["command"], "--max-num-batched-tokens") == budget
    largest = max(default_of(budget), BACKLOG_ON_CUDA)
    assert default_of(flag(gpu["command"], "--max-num-batched-tokens")) == largest
    env = compose["services"]["scheduler"]["environment"]
    # Passed through, empty where unset: the scheduler then settles it by the worker's device.
    assert env["TANDEM_BACKLOG_BATCHED_TOKENS"] == os.environ.get(
        "TANDEM_BACKLOG_BATCHED_TOKENS", ""
    )


def test_the_model_cache_is_a_named_volume_at_tandem_home(compose: dict[str, Any]) -> None:
    assert "models" in compose["volumes"]
    for name in ("tokenizer", "worker", "worker-gpu"):
        svc = compose["services"][name]
        assert f"models:{svc['environment']['TANDEM_HOME']}" in svc["volumes"], name


def test_tracing_goes_to_jaeger(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name in STAGES:
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317", name
        assert env["OTEL_SERVICE_NAME"] == f"tandem-{name.removesuffix('-gpu')}"
    published = {p.rsplit(":", 2)[-1] for p in services["jaeger"]["ports"]}
    assert {"4317", "16686"} <= published


def test_envoy_balances_over_the_tokenizer_replicas(compose: dict[str, Any]) -> None:
    services = compose["services"]
    tokenizer = services["tokenizer"]
    # No published port: N replicas would fight over it; Envoy's are the public ones.
    assert "ports" not in tokenizer
    envoy = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    clusters = {c["name"]: c for c in envoy["static_resources"]["clusters"]}
    listeners = {x["name"]: x for x in envoy["static_resources"]["listeners"]}
    published = {int(p.rsplit(":", 1)[1]): p for p in services["envoy"]["ports"]}
    # Each API: a listener, published on loopback by default (TANDEM_BIND opens it), routing
    # without a deadline (a stream lasts as long as generation does) to a cluster of every
    # replica's port of that API, re-resolved through Docker's DNS and health-checked.
    for listener_name, cluster_name, flag_name in (
        ("generation", "tokenizers", "--port"),
        ("openai", "tokenizers_http", "--http-port"),
    ):
        cluster = clusters[cluster_name]
        [endpoint] = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
        upstream = endpoint["endpoint"]["address"]["socket_address"]
        assert upstream == {
            "address": "tokenizer",
            "port_value": int(flag(tokenizer["command"], flag_name)),
        }
        assert cluster["type"] == "STRICT_DNS"  # every replica's A record, re-resolved
        listener = listeners[listener_name]
        port = listener["address"]["socket_address"]["port_value"]
        assert published[port] == f"127.0.0.1:{port}:{port}"
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        assert manager["stream_idle_timeout"] == "0s"  # a request may wait in the queue
        route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
        assert route["cluster"] == cluster_name
        assert route["timeout"] == "0s"
    assert clusters["tokenizers"]["health_checks"][0]["grpc_health_check"] == {}
    http2 = clusters["tokenizers"]["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]["explicit_http_config"]
    assert "http2_protocol_options" in http2
    # The HTTP API's replicas answer /health with 503 while they have no scheduler.
    http_check = clusters["tokenizers_http"]["health_checks"][0]["http_health_check"]
    assert http_check == {"path": "/health"}
    # A POST one replica has begun to answer is never sent to another.
    openai_route = listeners["openai"]["filter_chains"][0]["filters"][0]["typed_config"]
    retry = openai_route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["retry_policy"]
    assert set(retry["retry_on"].split(",")) <= {"connect-failure", "refused-stream"}
    assert services["envoy"]["volumes"] == ["./envoy/envoy.yaml:/etc/envoy/envoy.yaml:ro"]

    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    [job] = [j for j in prometheus["scrape_configs"] if j["job_name"] == "envoy"]
    assert job["static_configs"][0]["targets"] == [
        f"envoy:{envoy['admin']['address']['socket_address']['port_value']}"
    ]


def test_prometheus_finds_every_tokenizer_replica_through_dns() -> None:
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    [job] = [j for j in prometheus["scrape_configs"] if j["job_name"] == "tandem-tokenizer"]
    assert job["dns_sd_configs"][0]["names"] == ["tokenizer"]
    assert job["dns_sd_configs"][0]["type"] == "A"


def test_mounted_files_exist_and_grafana_reads_its_provisioned_datasource(
    compose: dict[str, Any],
) -> None:
    for svc in compose["services"].values():
        for volume in svc.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), volume
    datasources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/datasources.yml").read_text()
    )["datasources"]
    uids = {d["uid"]: d for d in datasources}
    # Grafana fills the URLs in from its environment: the compose network's names here, loopback
    # in docker-compose.host.yml (tests/deploy/test_host_override.py).
    assert uids["prometheus"]["url"] == "${TANDEM_PROMETHEUS_URL}"
    assert uids["jaeger"]["url"] == "${TANDEM_JAEGER_URL}"
    env = compose["services"]["grafana"]["environment"]
    assert env["TANDEM_PROMETHEUS_URL"] == "http://prometheus:9090"
    assert env["TANDEM_JAEGER_URL"] == "http://jaeger:16686"
    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/dashboards.yml").read_text()
    )["providers"][0]
    grafana = compose["services"]["grafana"]
    assert f"./grafana/dashboards:{provider['options']['path']}:ro" in grafana["volumes"]

    dashboard = json.loads((DEPLOY / "grafana/dashboards/tandem.json").read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "prometheus", panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]


@pytest.mark.parametrize("service", STAGES)
def test_each_compose_command_parses_with_its_process_flags(
    compose: dict[str, Any], service: str, tandem_home: Path, default_gguf: Path
) -> None:
    parse(compose["services"][service]["command"], tandem_home)


@pytest.mark.parametrize(
    ("deployment", "container"),
    [
        ("tandem-engine", "worker"),
        ("tandem-engine", "scheduler"),
        ("tandem-tokenizer", "tokenizer"),
    ],
)
def test_each_kubernetes_command_parses_with_its_process_flags(
    deployment: str, container: str, tandem_home: Path, default_gguf: Path
) -> None:
    parse(containers_of(deployment)[container]["command"], tandem_home)


def parse(command: list[Any], home: Path) -> None:
    """The process's own argument parser accepts the command (models resolved in `home`)."""
    argv = [str(a) for a in command]
    assert argv[:2] == ["python", "-m"], argv
    module = importlib.import_module(f"{argv[2]}.__main__")
    extra = ["--home", str(home)] if argv[2] != "services.scheduler" else []
    module.parse_args([*argv[3:], *extra])


# Kubernetes


def test_scheduler_and_worker_share_dev_shm_in_one_pod_as_one_user() -> None:
    pod = k8s_kind("Deployment", "tandem-engine")["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert pod["securityContext"]["runAsUser"] == dockerfile_uid()
    assert pod["securityContext"]["runAsNonRoot"] is True
    containers = containers_of("tandem-engine")
    for container in containers.values():
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert "runAsUser" not in container.get("securityContext", {})
    worker, scheduler = containers["worker"], containers["scheduler"]
    assert flag(worker["command"], "--device") == "cuda"
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert (
        flag(scheduler["command"], "--worker") == f"127.0.0.1:{flag(worker['command'], '--port')}"
    )
    assert flag(scheduler["command"], "--transport") == "shm"
    assert flag(worker["command"], "--max-num-seqs") == flag(scheduler["command"], "--max-num-seqs")


def test_tokenizers_reach_the_scheduler_service_over_grpc_alone() -> None:
    tokenizer = containers_of("tandem-tokenizer")["tokenizer"]
    assert flag(tokenizer["command"], "--transport") == "grpc"
    host, _, port = flag(tokenizer["command"], "--scheduler").rpartition(":")
    service = k8s_kind("Service", host)
    [service_port] = service["spec"]["ports"]
    assert service_port["port"] == int(port)
    scheduler = containers_of("tandem-engine")["scheduler"]
    named = {p["name"]: p["containerPort"] for p in scheduler["ports"]}
    assert named[service_port["targetPort"]] == int(flag(scheduler["command"], "--port"))
    engine_labels = k8s_kind("Deployment", "tandem-engine")["spec"]["template"]["metadata"]
    assert service["spec"]["selector"].items() <= engine_labels["labels"].items()


def test_every_container_is_probed_on_its_own_grpc_health() -> None:
    for deployment in ("tandem-engine", "tandem-tokenizer"):
        for container in containers_of(deployment).values():
            port = int(flag(container["command"], "--port"))
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert container[probe]["grpc"] == {"port": port}, (container["name"], probe)
            assert (
                flag(container["command"], "--host") == "0.0.0.0"
            )  # the kubelet probes the Pod IP


def test_the_otlp_endpoint_comes_from_the_configmap() -> None:
    config = k8s_kind("ConfigMap", "tandem-config")["data"]
    jaeger = k8s_kind("Service", "jaeger")["spec"]["ports"]
    assert config["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert any(p["port"] == 4317 for p in jaeger)
    for deployment in ("tandem-engine", "tandem-tokenizer"):
        for container in containers_of(deployment).values():
            assert {"configMapRef": {"name": "tandem-config"}} in container["envFrom"]
            names = {e["name"]: e["value"] for e in container["env"]}
            assert names["OTEL_SERVICE_NAME"] == f"tandem-{container['name']}"


def test_the_kubernetes_service_serves_both_public_apis() -> None:
    tokenizer = containers_of("tandem-tokenizer")["tokenizer"]
    named = {p["name"]: p["containerPort"] for p in tokenizer["ports"]}
    assert named["grpc"] == int(flag(tokenizer["command"], "--port"))
    assert named["http"] == int(flag(tokenizer["command"], "--http-port"))
    ports = {p["name"]: p for p in k8s_kind("Service", "tandem")["spec"]["ports"]}
    assert {ports[name]["targetPort"] for name in ("grpc", "http")} == {"grpc", "http"}
    assert ports["http"]["port"] == 8000


def test_the_tokenizers_are_scaled_horizontally() -> None:
    hpa = k8s_kind("HorizontalPodAutoscaler", "tandem-tokenizer")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "tandem-tokenizer"
    assert hpa["minReplicas"] >= 2
    tokenizer = containers_of("tandem-tokenizer")["tokenizer"]
    assert "cpu" in tokenizer["resources"]["requests"]  # what a CPU-utilization target needs
    headless = k8s_kind("Service", "tandem-tokenizers")["spec"]
    assert headless["clusterIP"] == "None"


# The Dockerfiles


def dockerfile_uid(name: str = "Dockerfile") -> int:
    match = re.search(r"^ARG UID=(\d+)$", (DEPLOY / name).read_text(), re.MULTILINE)
    assert match is not None
    return int(match[1])


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_the_images_are_built_as_the_makefile_builds_and_run_unprivileged(name: str) -> None:
    text = (DEPLOY / name).read_text()
    makefile = (ROOT / "Makefile").read_text()
    protoc = re.search(r"-m grpc_tools\.protoc (.*) \$\(PROTOS\)", makefile)
    assert protoc is not None
    assert f"python -m grpc_tools.protoc {protoc[1]} \\" in text  # the same flags, at build
    assert "protos/tandem/v1/*.proto protos/tandem/internal/v1/*.proto" in text
    assert dockerfile_uid(name) == dockerfile_uid()  # one uid: 0600 segments across images
    final = text.rsplit("\nFROM ", 1)[1]
    assert "\nUSER tandem\n" in final
    assert "TANDEM_HOME=/var/lib/tandem" in final

    # What setuptools packages is what the image copies, and what BuildKit's ignore file lets in.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    copied = set(re.findall(r"^COPY (?!--)(\S+)", text, re.MULTILINE))
    assert {f"{p}/" for p in packages - {"tandem"}} | {"tandem/__init__.py"} <= copied
    allowed = {
        line[1:]
        for line in (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    sources = {
        s for line in re.findall(r"^COPY (?!--)(.+) \S+$", text, re.MULTILINE) for s in line.split()
    }
    assert sources <= allowed
    # A `# syntax=` line would make BuildKit pull a frontend image: no registry is reachable here.
    assert not text.startswith("# syntax=")


def test_the_cpu_image_pins_the_makefiles_torch_from_the_index_or_a_local_wheel() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r"^TORCH_SPEC \?= (\S+)$", makefile, re.MULTILINE)
    assert pin is not None
    index = text.split("AS torch-index\n", 1)[1].split("\nFROM ", 1)[0]
    assert f'ARG TORCH_SPEC="{pin[1]}"' in index
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in index
    assert "ARG TORCH_SOURCE=index" in text.split("\nFROM ", 1)[0]  # the default, before any FROM
    assert "FROM torch-${TORCH_SOURCE} AS build" in text
    # Only the wheels stage reads .whl/, the one folder `make image` links a wheel into.
    wheels = text.split("AS torch-wheels\n", 1)[1].split("\nFROM ", 1)[0]
    assert "--mount=type=bind,source=.whl,target=/wheels" in wheels
    assert text.count("source=.whl") == 1
    assert "!.whl/torch-*.whl" in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()


# services/healthcheck.py


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(grace=None)


def test_the_healthcheck_exits_0_only_while_serving(
    health_server: tuple[health.HealthServicer, int],
) -> None:
    servicer, port = health_server
    address = f"127.0.0.1:{port}"
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([address]) == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([address]) == 1
    assert healthcheck.main([address, "--service", "tandem.v1.Nope"]) == 1  # NOT_FOUND
    assert healthcheck.main([f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 1
    assert healthcheck.main([]) == 1  # a usage error is unhealthy too, never Docker's reserved 2
