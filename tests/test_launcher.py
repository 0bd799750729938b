"""The launcher's supervision: with a stand-in child (a process that never reports healthy), and
the start of `tandem serve`'s processes on the tiny random model, up to what `make run` does."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from services import cli_serve, launcher
from services.cli_serve import Port, ServeConfig, parse_serve, start_children, tokenizer_config
from services.launcher import Child, LaunchFailed, ProcessSpec, Supervisor, free_port, wait_serving
from services.tokenizer.config import TokenizerConfig


@pytest.mark.parametrize("ended_by", ["shutdown", "another kill"])
async def test_a_restart_cut_short_is_logged_once_and_no_error(
    caplog: pytest.LogCaptureFixture, ended_by: str
) -> None:
    """A crashed child being started again is stopped by the server's shutdown, or killed again:
    the launcher logs no error for it, and the second kill once, as the exit it restarts from (a
    fault campaign counted each such line as a crash)."""
    spec = ProcessSpec(
        name="stand-in",
        module="http.server",  # runs until signalled and never answers gRPC health
        args=["0", "--bind", "127.0.0.1"],
        health_address=f"127.0.0.1:{free_port()}",
        stop_grace_s=10,
    )
    supervisor = Supervisor(dict(os.environ), ready_timeout_s=120)
    child = Child(spec)
    await supervisor._start(child)
    assert child.proc is not None
    first = child.proc
    watcher = asyncio.create_task(supervisor._watch(child))
    first.kill()
    async with asyncio.timeout(60):
        while child.proc is first:  # restarted after its delay; now waiting for it to be healthy
            await asyncio.sleep(0.05)
    restarted = child.proc
    assert restarted is not None
    caplog.set_level(logging.INFO, logger="tandem.launcher")
    caplog.clear()  # the first kill's line
    if ended_by == "another kill":
        restarted.kill()
        async with asyncio.timeout(60):
            while child.proc is restarted:
                await asyncio.sleep(0.05)
    supervisor.stopping = True  # what stop_all does first
    assert child.proc is not None
    last = child.proc
    last.send_signal(signal.SIGTERM)
    async with asyncio.timeout(60):
        await watcher
    assert last.returncode is not None
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for level, m in messages if level >= logging.ERROR] == []
    exits = [m for _, m in messages if "exited with code" in m]
    assert exits == (["stand-in exited with code -9; restarting in 2.0 s (restart 2)"]
                     if ended_by == "another kill" else [])  # fmt: skip


async def test_a_start_that_fails_after_the_health_watch_connected_is_named_by_its_exit() -> None:
    """The server's stop cuts the launcher's health watch before the process exits: the start's
    failure is still its exit code (the scheduler's own message is in its stderr), not the cut."""
    address = f"127.0.0.1:{free_port()}"
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    supervisor = Supervisor(dict(os.environ, PYTHONPATH=path), ready_timeout_s=120)
    try:
        with pytest.raises(LaunchFailed) as failed:
            await supervisor.start(
                lambda port: ProcessSpec("stand-in", "launcher_standin", [address], address, 10)
            )
    finally:
        await supervisor.stop_all()
    assert str(failed.value) == "stand-in exited with code 2 while starting"


def _taken(port: int) -> socket.socket:
    """Another process's listener on `port`."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def _serve_flags(*flags: str) -> list[str]:
    return ["--model", "llama3-tiny-random", "--port", str(free_port()), "--http-port", "0", *flags]


@pytest.mark.slow
async def test_a_port_taken_after_it_was_picked_is_picked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker binds its ports only once its model is loaded: ports picked for it may be taken
    meanwhile. It is started again on new ones, and the scheduler is told its new address."""
    thieves: list[socket.socket] = []

    def picked_then_taken() -> int:
        port = free_port()
        if len(thieves) < 2:  # the worker's first two: its gRPC port and its metrics port
            thieves.append(_taken(port))
        return port

    config = parse_serve(_serve_flags())
    monkeypatch.setattr(launcher, "free_port", picked_then_taken)
    caplog.set_level(logging.INFO, logger="tandem.launcher")
    supervisor = Supervisor(dict(os.environ), ready_timeout_s=240)
    try:
        _, (worker, *_) = await start_children(supervisor, config, tmp_path)
        taken = {str(t.getsockname()[1]) for t in thieves}
        assert len(taken) == 2
        assert worker.health_address.rsplit(":", 1)[1] not in taken
        assert worker.metrics_url.rsplit(":", 1)[1].split("/")[0] not in taken
        written = json.loads((tmp_path / "scheduler.json").read_text())
        assert written["worker"] == worker.health_address
        started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("started")]
        assert [m.split()[1] for m in started] == ["worker", "worker", "scheduler", "tokenizer-1"]
        assert any(r.getMessage().startswith("worker could not bind port") for r in caplog.records)
    finally:
        await supervisor.stop_all()
        for thief in thieves:
            thief.close()


def test_a_port_handed_out_is_not_picked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The OS may return a port again while the process it went to has not bound it yet."""
    offered = iter([7001, 7002, 7001, 7002, 7003])
    monkeypatch.setattr(launcher, "free_port", lambda: next(offered))
    supervisor = Supervisor({}, ready_timeout_s=1, reserved={7002})
    assert [supervisor.pick_port(), supervisor.pick_port()] == [7001, 7003]


@pytest.mark.slow
async def test_the_public_port_is_never_given_to_another_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The public port is picked before the worker loads and bound by the tokenizers after it: a
    CI run lost its tokenizer when the scheduler's metrics port, picked meanwhile, was the same."""
    config = parse_serve(_serve_flags())
    offered: list[int] = []

    def the_public_port_every_other_time() -> int:
        offered.append(config.port if len(offered) % 2 == 0 else free_port())
        return offered[-1]

    monkeypatch.setattr(launcher, "free_port", the_public_port_every_other_time)
    supervisor = Supervisor(dict(os.environ), ready_timeout_s=240)
    try:
        _, specs = await start_children(supervisor, config, tmp_path)
        given = [s.health_address for s in specs] + [s.metrics_url.split("/")[2] for s in specs]
        ports = [int(address.rsplit(":", 1)[1]) for address in given]
        assert len(set(ports)) == len(ports) == 6
        assert config.port not in ports
        assert offered.count(config.port) >= 6  # offered for each, and refused
    finally:
        await supervisor.stop_all()


@pytest.mark.slow
async def test_a_public_port_picked_then_taken_is_picked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """`--port 0`: the tokenizers bind the public port after the worker has loaded, seconds after
    it was picked. Taken meanwhile by another program, it is picked again, and every tokenizer
    shares the new one."""
    thieves: list[socket.socket] = []

    def taken_before_the_bind(config: ServeConfig, scheduler: str, port: Port) -> TokenizerConfig:
        if not thieves:
            thieves.append(_taken(config.port))
        return tokenizer_config(config, scheduler, port)

    monkeypatch.setattr(cli_serve, "tokenizer_config", taken_before_the_bind)
    caplog.set_level(logging.INFO, logger="tandem.launcher")
    flags = [*_serve_flags("--tokenizers", "2"), "--port", "0"]  # the last --port wins
    supervisor = Supervisor(dict(os.environ), ready_timeout_s=240)
    try:
        served, _ = await start_children(supervisor, parse_serve(flags), tmp_path)
        stolen = thieves[0].getsockname()[1]
        assert served.port not in (0, stolen)
        for name in ("tokenizer-1", "tokenizer-2"):
            assert json.loads((tmp_path / f"{name}.json").read_text())["port"] == served.port
        await wait_serving(f"127.0.0.1:{served.port}", 60)
        said = [r.getMessage() for r in caplog.records]
        assert f"tokenizer-1 could not bind port {stolen}; starting it on new ports" in said
    finally:
        await supervisor.stop_all()
        for thief in thieves:
            thief.close()


@pytest.mark.slow
async def test_a_port_the_user_gave_that_is_taken_fails_the_start_naming_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem.launcher")
    port = free_port()
    thief = _taken(port)
    supervisor = Supervisor(dict(os.environ), ready_timeout_s=240)
    try:
        config = parse_serve(_serve_flags("--worker-port", str(port)))
        with pytest.raises(LaunchFailed, match="worker exited with code 2 while starting"):
            await start_children(supervisor, config, tmp_path)
    finally:
        await supervisor.stop_all()
        thief.close()
    err = capfd.readouterr().err
    assert f"worker: error: cannot listen on 127.0.0.1:{port}: the port is in use" in err
    assert "Traceback" not in err
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("started")]
    assert len(started) == 1  # the worker, once: a port the user gave is never changed


async def _start_fails(tmp_path: Path, *flags: str) -> str:
    """`tandem serve` with these flags fails to start: what LaunchFailed says."""
    supervisor = Supervisor(dict(os.environ), ready_timeout_s=240)
    try:
        with pytest.raises(LaunchFailed) as failed:
            await start_children(supervisor, parse_serve(_serve_flags(*flags)), tmp_path)
    finally:
        await supervisor.stop_all()
    return str(failed.value)


@pytest.mark.slow
async def test_a_policy_that_cannot_schedule_the_model_fails_the_start_naming_why(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Chunked prefill off with a step budget below the model's contexts: the scheduler says so
    and exits, where it used to retry the attach until the launcher's ready timeout."""
    flags = ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "16")
    failed = await _start_fails(tmp_path, *flags)
    err = capfd.readouterr().err  # shown with any failure below: the processes' own account
    assert failed == "scheduler exited with code 2 while starting", err
    assert "scheduler cannot start: the worker at" in err
    assert "max_num_batched_tokens must be >= max_model_len when chunked prefill is off" in err


async def test_a_model_file_the_worker_cannot_read_fails_the_start_naming_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model")
    failed = await _start_fails(tmp_path, "--model", str(bad))
    assert failed == "worker exited with code 2 while starting"
    err = capfd.readouterr().err
    assert "worker: error: bad.gguf is not a readable GGUF file" in err
    assert "Traceback" not in err


@pytest.mark.slow
async def test_serve_demo_streams_a_reply_then_ctrl_c_stops_everything(tmp_path: Path) -> None:
    """What `make run` does (README): the pipeline on the CPU answers one streamed chat prompt,
    serves on, and Ctrl-C stops every process, exit code 0, nothing left in /dev/shm. With
    `--port 0` the launcher picks the public port, says which, and sends the demo there."""
    shm = Path("/dev/shm")
    before = {p.name for p in shm.glob("tandem-*")}
    argv = ["-c", "from services.cli import main; main()", "serve", "--demo", "Say hello."]
    flags = [*_serve_flags(), "--port", "0"]  # the last --port wins
    with (tmp_path / "serve.log").open("w") as log:
        serve = await asyncio.create_subprocess_exec(
            sys.executable, *argv, *flags, stdout=asyncio.subprocess.PIPE, stderr=log
        )
        assert serve.stdout is not None
        lines = []
        try:
            async with asyncio.timeout(300):
                while not lines or "still serving; Ctrl-C stops" not in lines[-1]:
                    line = (await serve.stdout.readline()).decode()
                    assert line, "tandem serve ended: " + "".join(lines)
                    lines.append(line)
        finally:
            serve.send_signal(signal.SIGINT)
            async with asyncio.timeout(120):
                code = await serve.wait()
    out = "".join(lines)
    assert "tandem serving llama3-tiny-random at 127.0.0.1:" in out and "> Say hello." in out
    assert "at 127.0.0.1:0 " not in out
    assert "[128 tokens, length]" in out or "tokens, stop]" in out  # a whole reply streamed
    assert code == 0, (tmp_path / "serve.log").read_text()[-2000:]
    assert {p.name for p in shm.glob("tandem-*")} <= before  # every segment unlinked


@pytest.mark.slow
async def test_a_demo_the_server_refuses_is_a_clear_error(tmp_path: Path) -> None:
    """A prompt longer than the model's context: the launcher says what the server answered,
    stops everything and exits 1, without a traceback."""
    shm = Path("/dev/shm")
    before = {p.name for p in shm.glob("tandem-*")}
    main = "import sys; from services.cli import main; sys.exit(main())"
    argv = ["-c", main, "serve", "--demo", "word " * 4000]
    serve = await asyncio.create_subprocess_exec(
        sys.executable, *argv, *_serve_flags(), stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(300):
        _, err = await serve.communicate()
    said = err.decode()
    assert serve.returncode == 1, said[-2000:]
    assert "the demo request failed: INVALID_ARGUMENT: prompt:" in said
    assert "do not fit the model's context of" in said and "Traceback" not in said
    assert {p.name for p in shm.glob("tandem-*")} <= before
