"""Lifecycle: names are 0600 while the owner lives and gone however it ends; the reaper; the CLI."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from _shm_peer import Peer

from services import cli_shm
from shm.arena import Arena
from shm.producer import RingProducer
from shm.reaper import reap, scan


def _files(arena: str, ring: str) -> list[str]:
    return [
        f"/dev/shm{arena}",
        f"/dev/shm{ring}",
        f"/dev/shm/sem.{ring[1:]}.data",
        f"/dev/shm/sem.{ring[1:]}.space",
    ]


def _start(spawn: Callable[..., Peer]) -> tuple[Peer, list[str]]:
    peer = spawn("hold")
    files = _files(*peer.lines(2))
    for path in files:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    return peer, files


def test_gone_after_normal_exit(spawn: Callable[..., Peer]) -> None:
    peer, files = _start(spawn)
    assert peer.finish() == 0
    assert not any(os.path.exists(f) for f in files)


def test_gone_after_sigterm(spawn: Callable[..., Peer]) -> None:
    peer, files = _start(spawn)
    peer.proc.send_signal(signal.SIGTERM)
    assert peer.proc.wait(30) == 0  # its handler leaves through the code that closes
    assert not any(os.path.exists(f) for f in files)


def test_sigkill_leaves_names_that_the_reaper_removes(spawn: Callable[..., Peer]) -> None:
    peer, files = _start(spawn)
    live = {e.path.name: e for e in scan()}
    assert all(live[f.rsplit("/", 1)[1]].alive for f in files)
    assert not any(e.path.name in live for e in reap(dry_run=True) if e.pid == peer.proc.pid)
    peer.kill()
    assert all(os.path.exists(f) for f in files)
    dead = {e.path.name for e in scan() if not e.alive}
    assert {f.rsplit("/", 1)[1] for f in files} <= dead
    reap()
    assert not any(os.path.exists(f) for f in files)


def test_an_owner_in_another_pid_namespace_is_judged_by_its_lock_not_its_pid() -> None:
    """As between containers sharing one /dev/shm: the owner is PID 1 of a namespace of its own,
    a PID that here is init's and always alive; its names go dead, and get reaped, when it dies."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    peer = Path(__file__).with_name("_shm_peer.py")
    path = os.pathsep.join(filter(None, [str(peer.parents[2]), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        # --kill-child: the peer (PID 1 in there) gets SIGKILL when unshare does.
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, str(peer), "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": path},
        text=True,
    )
    files: list[str] = []
    try:
        assert proc.stdout is not None
        names = [proc.stdout.readline().strip() for _ in range(2)]
        if not all(names):
            pytest.skip("this machine does not let us make a PID namespace (root or userns)")
        files = _files(*names)
        assert all(name.startswith("/tandem-1-") for name in names)  # its pid, in its namespace
        assert all(e.alive for e in scan() if f"/dev/shm/{e.path.name}" in files)
        assert not {f"/dev/shm/{e.path.name}" for e in reap(dry_run=True)} & set(files)
        proc.kill()
        proc.wait(30)
        proc.stdout.read()  # EOF once the peer is dead too: it holds the pipe's other end
        dead = {f"/dev/shm/{e.path.name}" for e in reap(dry_run=True)}
        assert set(files) <= dead
    finally:
        proc.kill()
        proc.wait(30)
        for name in files:  # only what this peer made: other dead owners are not this test's
            Path(name).unlink(missing_ok=True)


def test_reaper_spares_live_owners() -> None:
    with Arena.create(1 << 16) as arena, RingProducer.create(1 << 12) as ring:
        reap()
        assert all(os.path.exists(f) for f in _files(arena.name, ring.name))
    assert not any(os.path.exists(f) for f in _files(arena.name, ring.name))


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli_shm.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["shm", *argv])
    return int(args.func(args))


def test_cli_ls_and_gc(spawn: Callable[..., Peer], capsys: pytest.CaptureFixture[str]) -> None:
    peer, files = _start(spawn)
    names = [f.rsplit("/", 1)[1] for f in files]
    assert _cli("ls") == 0
    listing = capsys.readouterr().out
    for name in names:
        line = next(line for line in listing.splitlines() if line.startswith(name))
        assert "alive" in line
    peer.kill()
    assert _cli("gc", "--dry-run") == 0
    would = capsys.readouterr().out
    assert all(f"would unlink {name}" in would for name in names)
    assert all(os.path.exists(f) for f in files)
    assert _cli("gc") == 0
    done = capsys.readouterr().out
    assert all(f"unlinked {name}" in done for name in names)
    assert not any(os.path.exists(f) for f in files)
