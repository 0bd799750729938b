"""Fixtures for the shared-memory tests: peer processes, and a check that nothing leaks.

These tests import `shm.<module>`, never names from `shm` itself: when pytest puts tests/ on
sys.path, `shm` can resolve to this directory as a namespace package, while submodules still
resolve to the real package through the editable install.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from _shm_peer import Peer

from shm import reaper

_PIDS: set[int] = {os.getpid()}


def _ours() -> set[str]:
    """tandem entries in /dev/shm created by this test process or the peers it started."""
    return {e.path.name for e in reaper.scan() if e.pid in _PIDS}


@pytest.fixture(scope="session", autouse=True)
def no_leaks() -> Iterator[None]:
    yield
    leaked = _ours()
    assert not leaked, f"tests left shared memory behind: {sorted(leaked)}"


@pytest.fixture
def spawn() -> Iterator[Callable[..., Peer]]:
    started: list[Peer] = []

    def start(role: str, *args: object) -> Peer:
        peer = Peer(role, *args)
        _PIDS.add(peer.proc.pid)
        started.append(peer)
        return peer

    yield start
    for peer in started:
        peer.kill()
        if peer.proc.stdout is not None:
            peer.proc.stdout.close()
    reaper.reap()  # what a killed peer left; live owners (other people's) are untouched
