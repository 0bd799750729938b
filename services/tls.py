"""TLS settings of a door (the public edge, or an internal port reached across hosts), and what
grpc and uvicorn are given from them. No grpc here: the scheduler's pure policy imports these
settings through its config; services/process.py makes the credentials.

The names are vLLM's: `--ssl-certfile` and `--ssl-keyfile` are the server's certificate and
key; `--ssl-ca-certs` is the CA whose certificates clients must present (mutual TLS) and, on
an internal channel to another host, the CA that signed that host's certificate.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from services.settings import flag


@dataclass(frozen=True)
class TlsSettings:
    ssl_certfile: str = flag(
        "", "TLS certificate (PEM) of the public HTTP and gRPC ports (of this process's port)"
    )
    ssl_keyfile: str = flag("", "its private key (PEM)")
    ssl_ca_certs: str = flag(
        "", "CA certificates (PEM): clients must present a certificate that one of them signed"
    )

    def __post_init__(self) -> None:
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("TLS needs both --ssl-certfile and --ssl-keyfile")
        if self.ssl_ca_certs and not self.ssl_certfile:
            raise ValueError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
        for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path and not Path(path).expanduser().is_file():
                raise ValueError(f"{name}: no such file {path}")

    @property
    def enabled(self) -> bool:
        return bool(self.ssl_certfile)

    def secures(self, address: str) -> bool:
        """Whether a channel to `address` takes TLS: only with settings, and only off loopback
        (the internal ports of one host stay plaintext on loopback)."""
        return self.enabled and not is_loopback(address.rsplit(":", 1)[0].strip("[]"))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
