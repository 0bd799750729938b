"""Why an address cannot be listened on, in words a user can act on.

gRPC says only "Failed to bind"; binding a plain socket the way the server would gives the errno.
The tokenizers share their public ports through SO_REUSEPORT, which also lets any process of the
same user join them: `tandem serve` checks its public ports without it first, so a second server
on the same port is refused instead of silently taking half of the connections."""

from __future__ import annotations

import errno
import socket

from services.errors import CannotStart

_REASONS = {
    errno.EADDRINUSE: "the port is in use by another process",
    errno.EADDRNOTAVAIL: "the host is not an address of this machine",
    errno.EACCES: "a port below 1024 needs privileges",
}


class CannotListen(CannotStart):
    """An address this process cannot listen on."""

    def __init__(self, address: str, err: OSError | None) -> None:
        # None: a socket binds there, yet the server did not (a port taken only for a moment).
        reason = "the server could not open it, though it is free now"
        if err is not None:
            reason = _REASONS.get(err.errno or 0, err.strerror or str(err))
        super().__init__(f"cannot listen on {address}: {reason}")


def bind_error(host: str, port: int, reuse_port: bool = False) -> OSError | None:
    """What binding and listening on host:port as a server does (SO_REUSEADDR, and SO_REUSEPORT
    where asked) raises; None if it can. A port in TIME_WAIT is free to a server."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, port))
            s.listen()
    except OSError as err:
        return err
    return None
