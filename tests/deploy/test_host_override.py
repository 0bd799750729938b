"""docker-compose.host.yml over docker-compose.yml, checked without Docker.

The single-host deployment: every service on the host's network, every bind on loopback (the
public port on TANDEM_BIND), no port served twice but the tokenizers' shared public one, every
address a stage dials the port its peer binds, Prometheus' host targets the metrics ports, and
every stage command accepted by its process. `make deploy-test` runs the same files for real.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.compose_local import DEPLOY, read_dotenv, stage_module
from tests.deploy.compose_merge import HOST_FILE, load_merged
from tests.deploy.test_manifests import check_jsonschema, flag, parse

TOKENIZERS = ("tokenizer", "tokenizer-2")
CPU_STAGES = ("worker", "scheduler", *TOKENIZERS)


@pytest.fixture(scope="module")
def services() -> dict[str, Any]:
    return load_merged()


def stages(services: dict[str, Any]) -> dict[str, Any]:
    return {name: svc for name, svc in services.items() if stage_module(svc)}


def test_the_merged_files_validate_against_the_compose_specification(tmp_path: Path) -> None:
    for profiles in ({"cpu"}, {"gpu"}):
        merged = tmp_path / f"merged-{'-'.join(profiles)}.yml"
        merged.write_text(yaml.safe_dump({"services": load_merged(profiles=profiles)}))
        done = check_jsonschema(merged)
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_service_is_on_the_host_network_and_the_stages_share_one_ipc_namespace(
    services: dict[str, Any],
) -> None:
    assert set(stages(services)) == set(CPU_STAGES)
    assert set(services) == {*CPU_STAGES, "shm", "jaeger", "prometheus", "grafana"}  # no Envoy
    for name, svc in services.items():
        assert "networks" not in svc, name  # a network here would be a bridge network
        assert svc["network_mode"] == ("none" if name == "shm" else "host"), name
    for name in CPU_STAGES:
        assert services[name]["ipc"] == "service:shm", name
    gpu = load_merged(profiles={"gpu"})["worker-gpu"]
    assert gpu["network_mode"] == "host" and "networks" not in gpu
    assert flag(gpu["command"], "--port") == flag(services["worker"]["command"], "--port")


def test_binds_are_loopback_and_no_port_is_served_twice(services: dict[str, Any]) -> None:
    served: list[str] = []
    for name, svc in stages(services).items():
        command = [str(a) for a in svc["command"]]
        assert flag(command, "--metrics-host") == "127.0.0.1", name
        if name in TOKENIZERS:
            # The public door: loopback unless TANDEM_BIND opens it, as the base file's port.
            assert flag(command, "--host") == read_dotenv().get("TANDEM_BIND", "127.0.0.1")
            served.append(flag(command, "--admin-port"))
        else:
            assert flag(command, "--host") == "127.0.0.1", name
            served.append(flag(command, "--port"))
        served.append(flag(command, "--metrics-port"))
    public = {flag(services[t]["command"], "--port") for t in TOKENIZERS}
    assert public == {"50051"}  # shared (SO_REUSEPORT), the one public port
    assert len(served) == len(set(served)) and not public & set(served), served


def test_each_stage_dials_the_port_its_peer_binds_and_is_health_checked_on_its_own(
    services: dict[str, Any],
) -> None:
    def port(name: str, option: str = "--port") -> str:
        return f"127.0.0.1:{flag(services[name]['command'], option)}"

    assert flag(services["scheduler"]["command"], "--worker") == port("worker")
    for name in TOKENIZERS:
        assert flag(services[name]["command"], "--scheduler") == port("scheduler")
        assert services[name]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    health = {name: services[name]["healthcheck"]["test"][-1] for name in CPU_STAGES}
    assert health == {
        "worker": port("worker"),
        "scheduler": port("scheduler"),
        # The shared port would answer for either tokenizer: each is checked on its own.
        "tokenizer": port("tokenizer", "--admin-port"),
        "tokenizer-2": port("tokenizer-2", "--admin-port"),
    }


def test_the_second_tokenizer_is_the_first_but_for_its_ports(services: dict[str, Any]) -> None:
    first, second = (dict(services[t]) for t in TOKENIZERS)
    for svc in (first, second):
        svc.pop("command")
        svc.pop("healthcheck")
    assert first == second
    one, two = ([str(a) for a in services[t]["command"]] for t in TOKENIZERS)
    differ = [i for i, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    assert {one[i - 1] for i in differ} == {"--admin-port", "--metrics-port"}


def test_prometheus_scrapes_the_metrics_ports_on_loopback(services: dict[str, Any]) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.host.yml").read_text())
    targets = {
        job["job_name"]: sorted(t for sc in job["static_configs"] for t in sc["targets"])
        for job in config["scrape_configs"]
    }

    def metrics(*names: str) -> list[str]:
        return sorted(f"127.0.0.1:{flag(services[n]['command'], '--metrics-port')}" for n in names)

    assert targets == {
        "tandem-tokenizer": metrics(*TOKENIZERS),
        "tandem-scheduler": metrics("scheduler"),
        "tandem-worker": metrics("worker"),
    }
    prometheus = services["prometheus"]
    assert "--web.listen-address=127.0.0.1:9090" in prometheus["command"]
    assert (
        "./prometheus/prometheus.host.yml:/etc/prometheus/prometheus.yml:ro"
        in (prometheus["volumes"])
    )
    assert not any("prometheus.yml:/etc" in str(v) for v in prometheus["volumes"])


def test_telemetry_goes_to_loopback(services: dict[str, Any]) -> None:
    for name, svc in stages(services).items():
        env = svc["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://127.0.0.1:4317", name
        assert env["OTEL_SERVICE_NAME"] == f"tandem-{name.removesuffix('-2')}"
    assert services["jaeger"]["environment"]["JAEGER_LISTEN_HOST"] == "127.0.0.1"
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert grafana["TANDEM_PROMETHEUS_URL"] == "http://127.0.0.1:9090"
    assert grafana["TANDEM_JAEGER_URL"] == "http://127.0.0.1:16686"


@pytest.mark.parametrize("service", [*CPU_STAGES, "worker-gpu"])
def test_each_host_command_parses_with_its_process_flags(
    service: str, tandem_home: Path, default_gguf: Path
) -> None:
    parse(load_merged(profiles={"cpu", "gpu"})[service]["command"], tandem_home)


def test_compose_accepts_the_files_where_it_is_installed() -> None:
    """`docker compose config` when a Docker CLI with Compose is here; make test never needs it."""

    def compose(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker", "compose", *args], capture_output=True, text=True, timeout=60
        )

    try:
        probe = compose("version")
    except FileNotFoundError:
        pytest.skip("no docker CLI on this machine")
    if probe.returncode != 0:
        # Each CLI says it its own way ("is not a docker command", "unknown command").
        why = (probe.stderr.strip().splitlines() or ["?"])[0]
        pytest.skip(f"the docker CLI here has no Compose plugin ({why})")
    done = compose(
        "-f", str(DEPLOY / "docker-compose.yml"), "-f", str(HOST_FILE), "config", "--quiet"
    )
    assert done.returncode == 0, done.stderr
