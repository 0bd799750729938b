"""TLS settings of a door (the public edge, or an internal port reached across hosts), and what
grpc and uvicorn are given from them. No grpc here: the scheduler's pure policy imports these
settings through its config; services/process.py makes the credentials.

The names are vLLM's: `--ssl-certfile` and `--ssl-keyfile` are the server's certificate and
key; `--ssl-ca-certs` is the CA whose certificates clients must present (mutual TLS) and, on
an internal channel to another host, the CA that signed that host's certificate.
"""

from __future__ import annotations

import ipaddress
import ssl
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
        # Loaded once here, where the reason can be told: gRPC, given a bad file, only fails to
        # open the port, and uvicorn fails at its first handshake.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if self.ssl_certfile:
            cert, key = (str(Path(p).expanduser()) for p in (self.ssl_certfile, self.ssl_keyfile))
            try:  # a password-protected key fails here rather than prompting for one
                context.load_cert_chain(cert, key, password=lambda: b"")
            except (ssl.SSLError, OSError) as err:
                raise ValueError(
                    f"ssl_certfile, ssl_keyfile: {cert} and {key} are not a PEM certificate and "
                    f"its unencrypted private key ({err})"
                ) from err
        if self.ssl_ca_certs:
            try:
                context.load_verify_locations(str(Path(self.ssl_ca_certs).expanduser()))
            except (ssl.SSLError, OSError) as err:
                raise ValueError(
                    f"ssl_ca_certs: {self.ssl_ca_certs} holds no PEM CA certificate ({err})"
                ) from err

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
