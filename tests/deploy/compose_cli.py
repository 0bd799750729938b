"""`docker compose` on deploy/'s files, as the deploy test drives it: every call time-boxed.

One project (its own name, so a user's `tandem` project is never touched) over
docker-compose.yml + docker-compose.host.yml. Compose reads deploy/.env (the project directory
is the first file's folder); `env` adds to the caller's environment, e.g. the OTLP endpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.deploy.compose_local import DEPLOY

FILES = (DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.host.yml")


class CommandFailed(RuntimeError):
    pass


def now() -> float:
    return time.time()


@dataclass
class Compose:
    docker: str
    project: str
    env: Mapping[str, str] = field(default_factory=dict)

    def _argv(self, *args: str) -> list[str]:
        files = [a for f in FILES for a in ("-f", str(f))]
        return [self.docker, "compose", "-p", self.project, *files, *args]

    def run(
        self, *args: str, timeout: float, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = self._argv(*args)
        try:
            done = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
                env={**os.environ, **self.env},
            )
        except subprocess.TimeoutExpired:
            raise CommandFailed(f"timed out after {timeout:.0f} s: {' '.join(argv)}") from None
        if check and done.returncode != 0:
            output = done.stdout[-2000:] + done.stderr[-4000:]
            raise CommandFailed(f"exit {done.returncode}: {' '.join(argv)}\n{output}")
        return done

    def stream(self, *args: str, timeout: float) -> None:
        """A long command whose progress the user should see: output goes to the terminal."""
        argv = self._argv(*args)
        try:
            done = subprocess.run(argv, timeout=timeout, env={**os.environ, **self.env})
        except subprocess.TimeoutExpired:
            raise CommandFailed(f"timed out after {timeout:.0f} s: {' '.join(argv)}") from None
        if done.returncode != 0:
            raise CommandFailed(f"exit {done.returncode}: {' '.join(argv)}")

    def python(
        self, service: str, source: str, *args: str, timeout: float = 60, may_die: bool = False
    ) -> Any:
        """Run `source` with the service container's Python; its last line of JSON, parsed.

        `may_die`: the script kills the container's main process, and with it itself (exit 137),
        after printing its line."""
        argv = ("exec", "-T", service, "python", "-", *args)
        done = self.run(*argv, stdin=source, timeout=timeout, check=not may_die)
        lines = done.stdout.strip().splitlines()
        if done.returncode not in (0, 137) or not lines:
            raise CommandFailed(f"exit {done.returncode} of {' '.join(argv)}: {done.stderr}")
        return json.loads(lines[-1])

    def container(self, service: str) -> str:
        ids = self.run("ps", "-a", "-q", service, timeout=30).stdout.split()
        if len(ids) != 1:
            raise CommandFailed(f"expected one container of {service}, found {ids}")
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        return dict(json.loads(docker(self.docker, "inspect", self.container(service)))[0])

    def containers(self) -> list[str]:
        """Every container of the project, running or not (by Compose's label, not by name)."""
        return docker(self.docker, "ps", "-a", "-q", "--filter", self._label).split()

    def volumes(self) -> list[str]:
        return docker(self.docker, "volume", "ls", "-q", "--filter", self._label).split()

    @property
    def _label(self) -> str:
        return f"label=com.docker.compose.project={self.project}"

    def logs(self, services: Sequence[str] = (), tail: int = 40) -> str:
        args = ("logs", "--no-color", "--tail", str(tail), *services)
        done = self.run(*args, timeout=60, check=False)
        return done.stdout + done.stderr

    def down(self) -> None:
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "30", timeout=180)


def docker(cli: str, *args: str, timeout: float = 60) -> str:
    """A plain docker command's output; CommandFailed if it fails."""
    try:
        done = subprocess.run([cli, *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CommandFailed(f"timed out after {timeout:.0f} s: docker {' '.join(args)}") from None
    if done.returncode != 0:
        raise CommandFailed(f"exit {done.returncode}: docker {' '.join(args)}\n{done.stderr}")
    return done.stdout


def image_layers(cli: str, image: str) -> tuple[int, list[tuple[int, str]]]:
    """The image's size in bytes, and (bytes, the instruction) of each layer that has any."""
    size = docker(cli, "image", "inspect", "--format", "{{.Size}}", image).strip()
    fmt = "{{.Size}}\t{{.CreatedBy}}"
    history = docker(cli, "history", "--no-trunc", "--human=false", "--format", fmt, image)
    layers = []
    for line in history.splitlines():
        nbytes, _, created_by = line.partition("\t")
        if int(nbytes or 0) > 0:
            layers.append((int(nbytes), " ".join(created_by.split())))
    return int(size), layers
