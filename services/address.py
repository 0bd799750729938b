"""host:port strings as gRPC takes them: an IPv6 literal in brackets ("[::1]:50051")."""

from __future__ import annotations


def join_address(host: str, port: int) -> str:
    """ "host:port", with an IPv6 host in brackets (gRPC read "::1:50051" as a bad name)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)
