"""The HTTP door's server: uvicorn on the tokenizer's own event loop, on a socket of ours (with
SO_REUSEPORT, so several tokenizer processes share the port as they share the gRPC one), with
TLS from the same settings as the gRPC port."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import uvicorn
from fastapi import FastAPI

from services.address import join_address
from services.listen import CannotListen
from services.tls import TlsSettings

log = logging.getLogger(__name__)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise CannotListen(join_address(host, port), err) from err
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(
        self, app: FastAPI, host: str, port: int, tls: TlsSettings, grace_s: float
    ) -> None:
        self.socket = _bind(host.strip("[]"), port)
        self.port: int = self.socket.getsockname()[1]
        self.scheme = "https" if tls.enabled else "http"
        config = uvicorn.Config(
            app,
            loop="none",  # the process's own loop (uvloop)
            http="httptools",
            lifespan="off",
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=max(1, round(grace_s)),
            timeout_keep_alive=30,
            ssl_certfile=tls.ssl_certfile or None,
            ssl_keyfile=tls.ssl_keyfile or None,
            ssl_ca_certs=tls.ssl_ca_certs or None,
            ssl_cert_reqs=ssl.CERT_REQUIRED if tls.ssl_ca_certs else ssl.CERT_NONE,
        )
        self.server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        # uvicorn's serve() without its signal handlers: the process has its own (process.py).
        server, config = self.server, self.server.config
        config.load()
        server.lifespan = config.lifespan_class(config)
        await server.startup(sockets=[self.socket])
        self._task = asyncio.create_task(self._run())
        host, port = self.socket.getsockname()[:2]
        log.info("OpenAI-compatible HTTP API at %s://%s:%d/v1", self.scheme, host, port)

    async def _run(self) -> None:
        await self.server.main_loop()
        await self.server.shutdown(sockets=[self.socket])

    async def stop(self) -> None:
        """Stops accepting; requests in flight may finish within the grace period."""
        if self._task is None:
            return
        self.server.should_exit = True
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
