"""Transport security: TLS, mutual TLS, tokens over TLS, and the refusal to serve plaintext openly.

Every certificate is made here, for this run, with `cryptography`: a throwaway
CA, a server certificate for localhost and 127.0.0.1, a client certificate,
and a foreign CA with a client certificate of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ledger_server.auth import new_token
from ledger_server.config import ServerConfig
from ledger_server.server import RunningServer, create_server
from ledger_server.startup import is_loopback
from shard_client.api.shardledger.v1 import ledger_pb2 as pb
from shard_client.api.shardledger.v1 import ledger_pb2_grpc as pb_grpc
from shard_client.client import LedgerClient, channel_credentials
from tests.builders import planned

_ENV = ("SHARDLEDGER_TOKEN", "SHARDLEDGER_TLS_CA", "SHARDLEDGER_TLS_CERT", "SHARDLEDGER_TLS_KEY")


@dataclass(frozen=True, slots=True)
class Pki:
    """PEM file paths of the throwaway certificates."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    foreign_ca: str
    foreign_client_cert: str
    foreign_client_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    *,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None = None,
    ca: bool = False,
    sans: list[x509.GeneralName] | None = None,
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    issuer_name, issuer_key = issuer if issuer else (_name(subject), key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(
    directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[str, str]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Returns a CA, server and client certificates, and a foreign CA with its client."""
    d = tmp_path_factory.mktemp("pki")
    ca_key, foreign_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = _issue("shardledger test CA", ca_key, ca=True)
    foreign = _issue("some other CA", foreign_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = _issue(
        "localhost",
        server_key,
        issuer=(ca.subject, ca_key),
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = _issue(
        "gpu-job", client_key, issuer=(ca.subject, ca_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    stranger_key = ec.generate_private_key(ec.SECP256R1())
    stranger = _issue(
        "gpu-job",
        stranger_key,
        issuer=(foreign.subject, foreign_key),
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    ca_path, _ = _write(d, "ca", ca, ca_key)
    foreign_path, _ = _write(d, "foreign-ca", foreign, foreign_key)
    server_cert, server_key_path = _write(d, "server", server, server_key)
    client_cert, client_key_path = _write(d, "client", client, client_key)
    stranger_cert, stranger_key_path = _write(d, "stranger", stranger, stranger_key)
    return Pki(
        ca_path,
        server_cert,
        server_key_path,
        client_cert,
        client_key_path,
        foreign_path,
        stranger_cert,
        stranger_key_path,
    )


@pytest.fixture(autouse=True)
def _no_credentials_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK falls back to these variables; a developer's shell must not change the answers.
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def _serving(tmp_path: Path, **config: object) -> Iterator[RunningServer]:
    config.setdefault("listen", "127.0.0.1:0")
    running = create_server(ServerConfig(database=str(tmp_path / "ledger.db"), **config))  # type: ignore[arg-type]
    try:
        yield running
    finally:
        running.stop(0.5)


def _list_runs(channel: grpc.Channel) -> grpc.StatusCode:
    """Returns the code a ListRuns call gets on the channel."""
    try:
        pb_grpc.LedgerServiceStub(channel).ListRuns(pb.ListRunsRequest(), timeout=10)
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return code
    return grpc.StatusCode.OK


def _secure(target: str, **creds: str | None) -> grpc.Channel:
    credentials = channel_credentials(**creds)
    assert credentials is not None
    return grpc.secure_channel(target, credentials)


def _non_loopback_address() -> str | None:
    """Returns an address of this machine that is not loopback, or None."""
    # Connecting a UDP socket sends nothing; it only picks the outgoing interface.
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))
        address = str(s.getsockname()[0])
        if not ipaddress.ip_address(address).is_loopback and address != "0.0.0.0":
            return address
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            address = str(info[4][0])
            if not ipaddress.ip_address(address).is_loopback:
                return address
    return None


# --- TLS ------------------------------------------------------------------------


def test_tls_server_answers_a_client_trusting_its_ca(tmp_path: Path, pki: Pki) -> None:
    with _serving(tmp_path, tls_cert=pki.server_cert, tls_key=pki.server_key) as running:
        runs: set[str] = set()
        for host in ("localhost", "127.0.0.1"):
            client = LedgerClient(f"{host}:{running.port}", tls_ca=pki.ca, retry_deadline_s=5)
            try:
                client.append([planned(f"run-{host.replace('.', '-')}")])
                runs = {r.run_id for r in client.list_runs()}
            finally:
                client.close()
    assert runs == {"run-localhost", "run-127-0-0-1"}


def test_plaintext_client_to_the_tls_port_is_refused(tmp_path: Path, pki: Pki) -> None:
    with (
        _serving(tmp_path, tls_cert=pki.server_cert, tls_key=pki.server_key) as running,
        grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel,
    ):
        assert _list_runs(channel) == grpc.StatusCode.UNAVAILABLE


def test_tls_client_that_does_not_trust_the_ca_is_refused(tmp_path: Path, pki: Pki) -> None:
    with (
        _serving(tmp_path, tls_cert=pki.server_cert, tls_key=pki.server_key) as running,
        _secure(f"localhost:{running.port}", tls_ca=pki.foreign_ca) as channel,
    ):
        assert _list_runs(channel) == grpc.StatusCode.UNAVAILABLE


def test_tls_server_without_its_key_refuses_to_start(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(SystemExit, match="TLS needs both"):
        create_server(ServerConfig(database=str(tmp_path / "l.db"), tls_cert=pki.server_cert))
    with pytest.raises(SystemExit, match="mutual TLS"):
        create_server(ServerConfig(database=str(tmp_path / "l.db"), client_ca=pki.ca))


# --- mutual TLS -----------------------------------------------------------------


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[RunningServer]:
    """Starts one server that requires client certificates signed by the test CA."""
    with _serving(
        tmp_path_factory.mktemp("mtls"),
        tls_cert=pki.server_cert,
        tls_key=pki.server_key,
        client_ca=pki.ca,
    ) as running:
        yield running


def test_mutual_tls_accepts_a_client_certificate_from_its_ca(
    mtls_server: RunningServer, pki: Pki
) -> None:
    target = f"localhost:{mtls_server.port}"
    creds = {"tls_ca": pki.ca, "tls_cert": pki.client_cert, "tls_key": pki.client_key}
    with _secure(target, **creds) as channel:
        assert _list_runs(channel) == grpc.StatusCode.OK
    client = LedgerClient(
        target, retry_deadline_s=5, tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key
    )
    try:
        client.append([planned("mtls-run")])
        assert [r.run_id for r in client.list_runs()] == ["mtls-run"]
    finally:
        client.close()


def test_mutual_tls_refuses_a_client_without_a_certificate(
    mtls_server: RunningServer, pki: Pki
) -> None:
    with _secure(f"localhost:{mtls_server.port}", tls_ca=pki.ca) as channel:
        assert _list_runs(channel) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_certificate_from_a_foreign_ca(
    mtls_server: RunningServer, pki: Pki
) -> None:
    creds = {
        "tls_ca": pki.ca,
        "tls_cert": pki.foreign_client_cert,
        "tls_key": pki.foreign_client_key,
    }
    with _secure(f"localhost:{mtls_server.port}", **creds) as channel:
        assert _list_runs(channel) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_plaintext_client(mtls_server: RunningServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{mtls_server.port}") as channel:
        assert _list_runs(channel) == grpc.StatusCode.UNAVAILABLE


# --- tokens over TLS ---------------------------------------------------------------


def test_tokens_travel_over_tls(tmp_path: Path, pki: Pki) -> None:
    with _serving(
        tmp_path, tls_cert=pki.server_cert, tls_key=pki.server_key, auth="tokens"
    ) as running:
        token, row = new_token(
            namespace="alpha", role="writer", now_us=time.time_ns() // 1000, expires_us=None
        )
        running.ledger.store.create_token(row)
        target = f"localhost:{running.port}"
        with _secure(target, tls_ca=pki.ca) as channel:
            assert _list_runs(channel) == grpc.StatusCode.UNAUTHENTICATED
        client = LedgerClient(target, tls_ca=pki.ca, token=token, retry_deadline_s=5)
        try:
            client.append([planned("tls-token-run")])
            runs = client.list_runs()
        finally:
            client.close()
    assert [(r.namespace, r.run_id) for r in runs] == [("alpha", "tls-token-run")]


def test_tokens_and_client_certificates_combine(mtls_server: RunningServer, pki: Pki) -> None:
    # auth="auto" on loopback: the certificate is the credential; a token is simply ignored.
    token, _ = new_token(namespace="alpha", role="reader", now_us=0, expires_us=None)
    creds = {"tls_ca": pki.ca, "tls_cert": pki.client_cert, "tls_key": pki.client_key}
    with _secure(f"localhost:{mtls_server.port}", token=token, **creds) as channel:
        assert _list_runs(channel) == grpc.StatusCode.OK


# --- plaintext only on loopback ------------------------------------------------------


@pytest.mark.parametrize(
    ("listen", "loopback"),
    [
        ("127.0.0.1:50551", True),
        ("127.0.0.2:0", True),
        ("localhost:0", True),
        ("[::1]:0", True),
        ("0.0.0.0:50551", False),
        ("[::]:0", False),
        ("192.0.2.10:0", False),
        ("ledger.example.com:443", False),
        ("localhost.example.com:0", False),
        (":50551", False),
    ],
)
def test_only_loopback_addresses_count_as_loopback(listen: str, loopback: bool) -> None:
    assert is_loopback(listen) is loopback


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.10:0"])
def test_plaintext_on_a_non_loopback_address_is_refused_without_insecure(
    tmp_path: Path, listen: str
) -> None:
    db = tmp_path / "ledger.db"
    with pytest.raises(SystemExit) as refused:
        create_server(ServerConfig(database=str(db), listen=listen))
    message = str(refused.value.code)
    assert f"refusing to serve plaintext on non-loopback address {listen}" in message
    assert "--insecure" in message and "--tls-cert" in message
    assert not db.exists()  # refused before touching anything


def test_plaintext_on_a_non_loopback_address_starts_with_insecure(tmp_path: Path) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind")
    with (
        _serving(tmp_path, listen=f"{address}:0", insecure=True) as running,
        grpc.insecure_channel(f"{address}:{running.port}") as channel,
    ):
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # auth="auto" demands tokens off loopback, even when plaintext was allowed.
        assert _list_runs(channel) == grpc.StatusCode.UNAUTHENTICATED


def test_tls_on_a_non_loopback_address_needs_no_insecure(tmp_path: Path, pki: Pki) -> None:
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind")
    with _serving(
        tmp_path, listen=f"{address}:0", tls_cert=pki.server_cert, tls_key=pki.server_key
    ) as running:
        credentials = channel_credentials(tls_ca=pki.ca)
        assert credentials is not None
        # The certificate names localhost; the override checks it while dialing the real address.
        options = [("grpc.ssl_target_name_override", "localhost")]
        with grpc.secure_channel(f"{address}:{running.port}", credentials, options) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
