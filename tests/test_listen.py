"""Addresses that cannot be listened on are refused in one line that says why.

A second `tandem serve` on a port a running one serves used to start and share it: the
tokenizers listen with SO_REUSEPORT (so that several of them share the public port), which lets
any process of the same user join, and half of the connections went to the newcomer. A process
that could not bind its port died with gRPC's "Failed to bind" in a traceback."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from harness.pipeline import BIND_FAILED
from services.address import join_address, split_address
from services.cli_serve import parse_serve
from services.launcher import free_port
from services.listen import CannotListen, bind_error
from services.process import start_server

NOT_HERE = "192.0.2.1"  # TEST-NET-1: never an address of this machine


@pytest.fixture
def reuse_port_listener() -> Iterator[int]:
    """A port held as a tandem tokenizer holds its public one (SO_REUSEPORT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_why_an_address_cannot_be_listened_on(reuse_port_listener: int) -> None:
    port = reuse_port_listener
    assert bind_error("127.0.0.1", free_port()) is None
    # A tokenizer would join the listener; anything else, and the launcher's check, may not.
    assert bind_error("127.0.0.1", port, reuse_port=True) is None
    taken = bind_error("127.0.0.1", port)
    assert str(CannotListen(f"127.0.0.1:{port}", taken)) == (
        f"cannot listen on 127.0.0.1:{port}: the port is in use by another process"
    )


def test_the_test_harness_starts_over_on_new_ports_for_each_way_a_port_is_taken() -> None:
    """A CI run lost ten tests to a port taken while its process started: the harness's launch,
    which starts over on new ports, did not know our own words for it."""
    taken = OSError(errno.EADDRINUSE, "Address already in use")
    for said in (str(CannotListen("127.0.0.1:1", taken)), str(CannotListen("127.0.0.1:1", None))):
        assert BIND_FAILED.search(said)
    assert not BIND_FAILED.search(
        str(CannotListen(NOT_HERE + ":1", OSError(errno.EADDRNOTAVAIL, "")))
    )
    elsewhere = bind_error(NOT_HERE, 50051)
    assert str(CannotListen(f"{NOT_HERE}:50051", elsewhere)).endswith(
        "the host is not an address of this machine"
    )


def _serve(*flags: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", "from services.cli import main; raise SystemExit(main())"]
    argv += ["serve", *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_serve_on_a_port_another_server_holds_is_refused_before_starting_anything(
    reuse_port_listener: int,
) -> None:
    port = reuse_port_listener
    done = _serve("--model", "llama3-tiny-random", "--port", str(port), "--http-port", "0")
    assert done.returncode == 1, done.stderr
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}: the port is in use" in done.stderr
    assert "started worker" not in done.stderr  # refused before any process was started
    http = _serve("--model", "llama3-tiny-random", "--port", "0", "--http-port", str(port))
    assert http.returncode == 1, http.stderr
    assert f"--http-port {port}: cannot listen on 127.0.0.1:{port}" in http.stderr


def test_serve_on_a_host_that_is_not_this_machines_is_refused() -> None:
    done = _serve("--host", NOT_HERE, "--port", "0", "--http-port", "0")
    assert done.returncode == 1, done.stderr
    assert "the host is not an address of this machine" in done.stderr
    assert "Traceback" not in done.stderr


def test_grpc_and_http_on_one_port_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="port and http_port are both 50099"):
        parse_serve(["--port", "50099", "--http-port", "50099"])
    parse_serve(["--port", "0", "--http-port", "0"])  # two free ones, picked apart


def test_a_process_that_cannot_bind_its_port_says_so_in_one_line() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = [sys.executable, "-m", "services.scheduler", "--port", str(port)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert (
        f"scheduler: error: cannot listen on 127.0.0.1:{port}: the port is in use by another "
        "process"
    ) in done.stderr
    assert "Traceback" not in done.stderr


def test_an_ipv6_host_is_bracketed_where_an_address_is_made() -> None:
    """`--host ::1` made "::1:50051", which gRPC refused as a misformatted name."""
    assert join_address("::1", 50051) == "[::1]:50051"
    assert join_address("[::1]", 50051) == "[::1]:50051"
    assert join_address("127.0.0.1", 1) == "127.0.0.1:1"
    assert split_address("[::1]:50051") == ("::1", 50051)
    serve = parse_serve(["--host", "::1", "--port", "50051"])
    assert serve.address == "[::1]:50051"


@pytest.mark.skipif(bind_error("::1", 0) is not None, reason="this machine has no IPv6 loopback")
async def test_a_grpc_server_listens_on_an_ipv6_host() -> None:
    server = await start_server(join_address("::1", 0), lambda s: None, [])
    try:
        assert server.port > 0
    finally:
        await server.stop(0)
