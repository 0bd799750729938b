"""docker-compose.yml with docker-compose.host.yml over it, merged as Compose merges them.

Only the rules those two files need, from the compose specification's merge section: mappings
merge key by key; `command`, `entrypoint` and `healthcheck.test` are replaced; `volumes` merge by
their target path; other sequences keep the base's items and add the override's; `!reset` drops
the key; `extends: {file, service}` starts from that file's service, then applies its own keys.
`make deploy-test` runs Compose's own merge (`docker compose config`); this one lets `make test`
check the result without Docker.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.deploy.compose_local import (
    COMPOSE_FILE,
    DEPLOY,
    RESET,
    active_services,
    default_profiles,
    load_compose,
)

HOST_FILE = DEPLOY / "docker-compose.host.yml"
REPLACED = frozenset({"command", "entrypoint", "test"})


def _target(volume: Any) -> str:
    if isinstance(volume, Mapping):
        return str(volume["target"])
    parts = str(volume).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def merge(base: Any, over: Any, key: str = "") -> Any:
    if isinstance(base, Mapping) and isinstance(over, Mapping):
        out = dict(base)
        for k, v in over.items():
            if v is RESET:
                out.pop(k, None)
            else:
                out[k] = merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(over, list) and key not in REPLACED:
        if key == "volumes":
            targets = {_target(v) for v in over}
            return [v for v in base if _target(v) not in targets] + list(over)
        return list(base) + [v for v in over if v not in base]
    return copy.deepcopy(over)


def _service(name: str, files: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    """One service after every file; `extends` resolved against the file it names."""
    out: dict[str, Any] = {}
    for path, compose in files:
        svc = compose.get("services", {}).get(name)
        if svc is None:
            continue
        own = dict(svc)
        extends = own.pop("extends", None)
        if extends is not None:
            source = (path.parent / extends.get("file", path.name)).resolve()
            [(_, origin)] = [(p, c) for p, c in files if p.resolve() == source]
            out = merge(origin["services"][extends["service"]], own)
        else:
            out = merge(out, own)
    return out


def load_merged(
    files: tuple[Path, ...] = (COMPOSE_FILE, HOST_FILE), profiles: set[str] | None = None
) -> dict[str, Any]:
    """The services Compose runs from `files` with these profiles (default: .env's)."""
    loaded = [(path, load_compose(path)) for path in files]
    names = list(dict.fromkeys(n for _, c in loaded for n in c.get("services", {})))
    merged = {name: _service(name, loaded) for name in names}
    active = default_profiles() if profiles is None else profiles
    return active_services({"services": merged}, active)
