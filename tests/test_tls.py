"""TLS settings: what they accept, which channels they secure, and a gRPC server that takes
them (mutual TLS with a CA made here), as every process's port does across hosts."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import trustme
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.process import channel_credentials, start_server
from services.tls import TlsSettings


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, str]:
    ca = trustme.CA()
    server, client = ca.issue_cert("localhost"), ca.issue_cert("scheduler.internal")
    files = {
        "ca": ca.cert_pem,
        "cert": server.cert_chain_pems[0],
        "key": server.private_key_pem,
        "ccert": client.cert_chain_pems[0],
        "ckey": client.private_key_pem,
    }
    for name, blob in files.items():
        blob.write_to_path(str(tmp_path / f"{name}.pem"))
    return {name: str(tmp_path / f"{name}.pem") for name in files}


def test_settings_are_checked(certs: dict[str, str]) -> None:
    assert not TlsSettings().enabled
    with pytest.raises(ValueError, match="both"):
        TlsSettings(ssl_certfile=certs["cert"])
    with pytest.raises(ValueError, match="ssl-certfile"):
        TlsSettings(ssl_ca_certs=certs["ca"])
    with pytest.raises(ValueError, match="no such file"):
        TlsSettings(ssl_certfile="/nonexistent.pem", ssl_keyfile=certs["key"])


def test_files_that_are_not_a_certificate_and_its_key_are_named_at_once(
    certs: dict[str, str], tmp_path: Path
) -> None:
    """gRPC given them only failed to open the port, which read as a port in use."""
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match="not a PEM certificate and its unencrypted private key"):
        TlsSettings(ssl_certfile=str(garbage), ssl_keyfile=certs["key"])
    with pytest.raises(ValueError, match="not a PEM certificate"):  # another certificate's key
        TlsSettings(ssl_certfile=certs["cert"], ssl_keyfile=certs["ckey"])
    with pytest.raises(ValueError, match=r"ssl_ca_certs: .* holds no PEM CA certificate"):
        TlsSettings(ssl_certfile=certs["cert"], ssl_keyfile=certs["key"], ssl_ca_certs=str(garbage))


def test_only_channels_to_other_hosts_take_tls(certs: dict[str, str]) -> None:
    tls = TlsSettings(ssl_certfile=certs["cert"], ssl_keyfile=certs["key"])
    for local in ("127.0.0.1:50052", "127.0.0.2:1", "localhost:1", "[::1]:1"):
        assert not tls.secures(local), local
    assert tls.secures("10.0.0.7:50052") and tls.secures("scheduler.internal:50052")
    assert not TlsSettings().secures("10.0.0.7:50052")


async def test_a_server_with_tls_serves_only_clients_with_a_certificate(
    certs: dict[str, str],
) -> None:
    tls = TlsSettings(
        ssl_certfile=certs["cert"], ssl_keyfile=certs["key"], ssl_ca_certs=certs["ca"]
    )
    server = await start_server("127.0.0.1:0", lambda s: None, [], tls=tls)
    address = f"localhost:{server.port}"
    client_side = TlsSettings(
        ssl_certfile=certs["ccert"], ssl_keyfile=certs["ckey"], ssl_ca_certs=certs["ca"]
    )
    request = health_pb2.HealthCheckRequest()
    try:
        async with aio.secure_channel(address, channel_credentials(client_side)) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        no_cert = grpc.ssl_channel_credentials(Path(certs["ca"]).read_bytes())
        for channel in (aio.secure_channel(address, no_cert), aio.insecure_channel(address)):
            async with channel:
                with pytest.raises(aio.AioRpcError) as err:
                    await health_pb2_grpc.HealthStub(channel).Check(request, timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
