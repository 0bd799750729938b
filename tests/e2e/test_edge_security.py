"""API keys and TLS at the edge, against a real `tandem serve` with two keys and mutual TLS
(a CA made here, a server and a client certificate it signed): HTTP and gRPC refuse what has
no valid key or no TLS; health checks stay open."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.pipeline import Pipeline, pipeline
from services.client import Client
from services.client_types import Connection, TandemError

pytestmark = pytest.mark.slow

KEYS = ("key-one", "key-two")
CHAT = [{"role": "user", "content": "Hi"}]


@dataclass
class Pki:
    ca: Path
    cert: Path  # the server's
    key: Path
    client_cert: Path
    client_key: Path

    def client_context(self, with_cert: bool = True) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if with_cert:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def connection(self, api_key: str | None = None, with_cert: bool = True) -> Connection:
        return Connection(
            api_key=api_key,
            ssl_ca_certs=str(self.ca),
            ssl_certfile=str(self.client_cert) if with_cert else None,
            ssl_keyfile=str(self.client_key) if with_cert else None,
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@tandem.test")
    paths = Pki(*(root / n for n in ("ca.pem", "cert.pem", "key.pem", "ccert.pem", "ckey.pem")))
    ca.cert_pem.write_to_path(str(paths.ca))
    server.cert_chain_pems[0].write_to_path(str(paths.cert))
    server.private_key_pem.write_to_path(str(paths.key))
    client.cert_chain_pems[0].write_to_path(str(paths.client_cert))
    client.private_key_pem.write_to_path(str(paths.client_key))
    return paths


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Pipeline]:
    flags = [
        "--model", "llama3-tiny-random", "--api-key", KEYS[0],
        "--ssl-certfile", str(pki.cert), "--ssl-keyfile", str(pki.key),
        "--ssl-ca-certs", str(pki.ca),
    ]  # fmt: skip
    env = {"TANDEM_API_KEY": KEYS[1]}  # the command line's keys win over it
    with pipeline(tmp_path_factory.mktemp("secure"), *flags, env=env) as running:
        yield running


def sdk(served: Pipeline, pki: Pki, key: str) -> openai.OpenAI:
    http = openai.DefaultHttpxClient(verify=pki.client_context())
    return openai.OpenAI(base_url=served.http_url, api_key=key, http_client=http, max_retries=0)


def test_https_with_a_key_serves(served: Pipeline, pki: Pki) -> None:
    assert served.http_url.startswith("https://")
    with sdk(served, pki, KEYS[0]) as client:
        reply = client.chat.completions.create(model="", messages=CHAT, max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("key", ["key-on", "key-one-more", KEYS[1]])
def test_http_without_a_valid_key_is_401(served: Pipeline, pki: Pki, key: str) -> None:
    with sdk(served, pki, key) as client, pytest.raises(openai.AuthenticationError) as err:
        client.models.list()
    assert err.value.status_code == 401


def test_health_and_metrics_need_no_key(served: Pipeline, pki: Pki) -> None:
    root = served.http_url.removesuffix("/v1")
    with httpx.Client(verify=pki.client_context(), timeout=30) as http:
        assert http.get(f"{root}/health").status_code == 200
        assert http.get(f"{root}/metrics").status_code == 200
        refused = http.post(f"{root}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_api_key"
        basic = {"Authorization": f"Basic {KEYS[0]}"}
        assert http.get(f"{root}/v1/models", headers=basic).status_code == 401


def test_plaintext_to_the_tls_ports_fails_cleanly(served: Pipeline) -> None:
    plain = served.http_url.replace("https://", "http://")
    with httpx.Client(timeout=10) as http, pytest.raises(httpx.HTTPError):
        http.get(f"{plain}/models", headers={"Authorization": f"Bearer {KEYS[0]}"})
    with Client(served.address, api_key=KEYS[0]) as client, pytest.raises(TandemError) as err:
        client.list_models(timeout=10)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_needs_a_client_certificate_signed_by_the_ca(served: Pipeline, pki: Pki) -> None:
    root = served.http_url.removesuffix("/v1")
    no_cert = pki.client_context(with_cert=False)
    with httpx.Client(verify=no_cert, timeout=10) as http, pytest.raises(httpx.HTTPError):
        http.get(f"{root}/health")
    anonymous = pki.connection(KEYS[0], with_cert=False)
    with Client(served.address, connection=anonymous) as client, pytest.raises(TandemError):
        client.list_models(timeout=10)


def test_grpc_needs_the_key_in_metadata(served: Pipeline, pki: Pki) -> None:
    with Client(served.address, connection=pki.connection(KEYS[0])) as client:
        assert client.list_models(timeout=30)[0].name == "llama3-tiny-random"
        assert client.complete("Hi", max_tokens=2, ignore_eos=True).finish_reason == "length"
    for key in (None, "wrong"):
        with Client(served.address, connection=pki.connection(key)) as client:
            with pytest.raises(TandemError) as err:
                client.complete("Hi", max_tokens=2)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(TandemError) as err:
                client.list_models(timeout=30)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_health_needs_no_key(served: Pipeline, pki: Pki) -> None:
    credentials = pki.connection().credentials()
    with grpc.secure_channel(served.address, credentials) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_the_server_said_nothing_of_an_open_api(served: Pipeline) -> None:
    assert "the API is open" not in served.log()
