"""deploy/docker-compose.yml's tandem stages as local processes: what Compose would run, here.

Nothing is copied out of the compose file by hand: each stage's `command`, `environment` and
`healthcheck` are read from it (after Compose's own `${VAR:-default}` interpolation with
deploy/.env), and only what a container has that this host lacks is mapped:

- a compose service name (or network alias) in `HOST:PORT` becomes 127.0.0.1;
- every (container, port) pair gets a free local port, the same wherever it is named
  (`--port 50052` in the scheduler, `scheduler:50052` in the tokenizer's `--scheduler`);
- `--host 0.0.0.0` / `--metrics-host 0.0.0.0` bind loopback instead;
- a named volume's mount path in a variable (TANDEM_HOME) becomes a local folder;
- `python` is this interpreter; services outside the stages (Jaeger) are given as addresses;
- the shared IPC namespace is the host's own /dev/shm.

Anything else that names a container address makes the translation fail, so a compose file
that only works by accident does not pass.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.launcher import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
ENV_FILE = DEPLOY / ".env"

PORT_FLAGS = frozenset({"--port", "--http-port", "--admin-port", "--metrics-port"})
BIND_FLAGS = frozenset({"--host", "--metrics-host"})
LOOPBACK = frozenset({"127.0.0.1", "localhost"})
_VARIABLE = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
_HOST_PORT = re.compile(r"(?P<host>[A-Za-z0-9][A-Za-z0-9.-]*):(?P<port>\d{1,5})")
_DURATION = re.compile(r"(?:(?P<m>\d+)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?")


def read_dotenv(path: Path = ENV_FILE) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def interpolate(text: str, variables: Mapping[str, str]) -> str:
    """Compose's interpolation: ${A}, $A, ${A:-default} (unset or empty), ${A-default}, $$."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        expr = match["braced"] if match["braced"] is not None else match["bare"]
        for sep, empty_too in ((":-", True), ("-", False)):
            name, found, default = expr.partition(sep)
            if found:
                value = variables.get(name)
                return default if value is None or (empty_too and not value) else value
        if match["braced"] is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", expr):
            raise ValueError(f"interpolation this test does not implement: {match[0]}")
        return variables.get(expr, "")

    return _VARIABLE.sub(one, text)


def _interpolated(node: Any, variables: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, variables)
    if isinstance(node, list):
        return [_interpolated(x, variables) for x in node]
    if isinstance(node, dict):
        return {k: _interpolated(v, variables) for k, v in node.items()}
    return node


class _Reset:
    """Compose's `!reset` tag in an override file: drop what the files before it set here."""


RESET = _Reset()


class ComposeLoader(yaml.SafeLoader):
    pass


ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)


def load_compose(
    path: Path = COMPOSE_FILE, variables: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The compose file as Compose sees it when no shell variable is set: .env, then defaults."""
    raw = yaml.load(path.read_text(), Loader=ComposeLoader)  # a SafeLoader, plus `!reset`
    return dict(_interpolated(raw, read_dotenv() if variables is None else variables))


def active_services(compose: Mapping[str, Any], profiles: set[str]) -> dict[str, Any]:
    """The services `docker compose up` starts with these profiles active."""
    return {
        name: svc
        for name, svc in compose["services"].items()
        if not svc.get("profiles") or profiles & set(svc["profiles"])
    }


def default_profiles() -> set[str]:
    return {p for p in read_dotenv().get("COMPOSE_PROFILES", "").split(",") if p}


def stage_module(service: Mapping[str, Any]) -> str | None:
    """`services.worker` for a tandem stage (`python -m services.<name> ...`), else None."""
    command = service.get("command")
    if isinstance(command, list) and command[:2] == ["python", "-m"]:
        module = str(command[2])
        return module if module.startswith("services.") else None
    return None


def names_of(services: Mapping[str, Any]) -> dict[str, str]:
    """Every name a container answers to on the compose network -> its service."""
    out = {name: name for name in services}
    for name, svc in services.items():
        for net in (svc.get("networks") or {}).values():
            for alias in (net or {}).get("aliases", []):
                out[alias] = name
    return out


def start_order(services: Mapping[str, Any], stages: list[str]) -> list[str]:
    """Stages in the order their `depends_on: condition: service_healthy` imposes."""
    order: list[str] = []
    remaining = list(stages)
    while remaining:
        ready = [
            s
            for s in remaining
            if all(
                dep in order or dep not in stages for dep in (services[s].get("depends_on") or {})
            )
        ]
        if not ready:
            raise ValueError(f"depends_on has a cycle among {remaining}")
        order += ready
        remaining = [s for s in remaining if s not in ready]
    return order


def seconds(duration: str) -> float:
    match = _DURATION.fullmatch(duration)
    if not duration or match is None:
        raise ValueError(f"not a compose duration this test reads: {duration!r}")
    return 60 * float(match["m"] or 0) + float(match["s"] or 0)


@dataclass
class PortMap:
    """(instance, container port) -> a free local port, allocated on first mention."""

    ports: dict[tuple[str, int], int] = field(default_factory=dict)

    def local(self, instance: str, port: int) -> int:
        if (instance, port) not in self.ports:
            # A port picked free is not held: a later pick may be an earlier one again.
            given = set(self.ports.values())
            self.ports[(instance, port)] = next(p for p in iter(free_port, 0) if p not in given)
        return self.ports[(instance, port)]

    def known(self, instance: str, port: int) -> int | None:
        return self.ports.get((instance, port))


@dataclass
class LocalStage:
    service: str
    instance: str  # the service name, or `tokenizer-2` for a second replica
    argv: list[str]
    env: dict[str, str]
    health_argv: list[str]
    stop_grace_s: float
    grpc_port: int  # local; its container port is the command's --port
    http_port: int  # local; 0 when the command serves no OpenAI-compatible HTTP
    metrics_port: int  # local; 0 when the command serves no metrics
    container_metrics_port: int


class Translator:
    """Rewrites one compose file's stage commands and variables for processes on this host."""

    def __init__(
        self,
        services: Mapping[str, Any],
        volumes: Mapping[str, Path],
        external: Mapping[str, str],
    ) -> None:
        self.services = services
        self.names = names_of(services)
        self.volumes = volumes  # named volume -> local folder
        self.external = external  # "jaeger:4317" -> "127.0.0.1:PORT" for non-stage services
        self.ports = PortMap()

    def _address(self, instance: str, host: str, port: int) -> str:
        if host in LOOPBACK:
            return f"127.0.0.1:{self.ports.local(instance, port)}"
        if f"{host}:{port}" in self.external:
            return self.external[f"{host}:{port}"]
        target = self.names.get(host)
        if target is None:
            raise ValueError(f"{instance} names {host}:{port}, which no compose service answers")
        if stage_module(self.services[target]) is None:
            raise ValueError(f"{instance} names {host}:{port}: give this test a local address")
        return f"127.0.0.1:{self.ports.local(target, port)}"

    def _in_text(self, instance: str, text: str) -> str:
        def one(match: re.Match[str]) -> str:
            return self._address(instance, match["host"], int(match["port"]))

        return _HOST_PORT.sub(one, text)

    def argv(self, instance: str, command: list[str]) -> list[str]:
        out: list[str] = []
        for i, arg in enumerate(str(a) for a in command):
            flag = str(command[i - 1]) if i else ""
            if i == 0 and arg == "python":
                arg = sys.executable
            elif flag in PORT_FLAGS:
                arg = str(self.ports.local(instance, int(arg)))
            elif flag in BIND_FLAGS:
                if arg not in ("0.0.0.0", *LOOPBACK):
                    raise ValueError(f"{instance}: {flag} {arg} is no address this test binds")
                arg = "127.0.0.1"
            else:
                arg = self._in_text(instance, arg)
            out.append(arg)
        return out

    def env(self, service: str, instance: str) -> dict[str, str]:
        svc = self.services[service]
        mounts = {}
        for volume in svc.get("volumes", []):
            name, _, target = str(volume).partition(":")
            target = target.split(":")[0]
            if name in self.volumes:
                mounts[target] = str(self.volumes[name])
        out = {}
        for key, value in (svc.get("environment") or {}).items():
            text = str(value)
            for target, local in mounts.items():
                if text == target or text.startswith(target + "/"):
                    text = local + text[len(target) :]
            if text.startswith("/") and text not in mounts.values():
                raise ValueError(f"{service}: {key}={text} is a container path with no volume")
            out[key] = self._in_text(instance, text)
        return out

    def stage(self, service: str, instance: str | None = None) -> LocalStage:
        instance = instance or service
        svc = self.services[service]
        command = [str(a) for a in svc["command"]]
        argv = self.argv(instance, command)

        def flag(name: str) -> int:
            return int(command[command.index(name) + 1]) if name in command else 0

        test = [str(a) for a in svc["healthcheck"]["test"]]
        if test[0] != "CMD":
            raise ValueError(f"{service}: the health check must be exec form (CMD), got {test}")
        return LocalStage(
            service=service,
            instance=instance,
            argv=argv,
            env=self.env(service, instance),
            health_argv=self.argv(instance, test[1:]),
            stop_grace_s=seconds(str(svc.get("stop_grace_period", "10s"))),
            grpc_port=self.ports.local(instance, flag("--port")),
            http_port=(
                self.ports.local(instance, flag("--http-port")) if flag("--http-port") else 0
            ),
            metrics_port=(
                self.ports.local(instance, flag("--metrics-port"))
                if "--metrics-port" in command
                else 0
            ),
            container_metrics_port=flag("--metrics-port"),
        )
