"""TLS, mutual TLS and bearer tokens with per-method permissions, with certificates made by
openssl for the test; and the plaintext health port Kubernetes probes use when TLS is on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from attnserve import Client, PermissionDenied, Unauthenticated, Unavailable
from attnserve.v1 import attention_pb2 as pb
from attnserve.v1 import server_config_pb2 as config_pb

from launcher import Launched, free_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            f"/CN={name}", "-keyout", str(key), "-out", str(cert))  # fmt: skip
    return key, cert


def make_leaf(d: Path, name: str, ca: tuple[Path, Path], server: bool) -> tuple[Path, Path]:
    key, csr, cert, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n" if server else
                   "extendedKeyUsage=clientAuth\n")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(key),
            "-out", str(csr))  # fmt: skip
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]),
            "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(d, "ca"), make_ca(d, "other-ca")
    server_key, server_cert = make_leaf(d, "server", ca, server=True)
    client_key, client_cert = make_leaf(d, "client", ca, server=False)
    other_key, other_cert = make_leaf(d, "other-client", ca, server=False)
    rogue_key, rogue_cert = make_leaf(d, "rogue", other_ca, server=False)
    return {"ca": ca[1], "other_ca": other_ca[1], "server_key": server_key,
            "server_cert": server_cert, "client_key": client_key, "client_cert": client_cert,
            "rogue_key": rogue_key, "rogue_cert": rogue_cert, "other_key": other_key,
            "other_cert": other_cert}  # fmt: skip


def config(tokens: bool = False) -> config_pb.ServerConfig:
    c = config_pb.ServerConfig()
    c.pools.add(name="p", kind=pb.POOL_KIND_GQA, num_layers=1, page_size=16, num_qo_heads=4,
                num_kv_heads=1, head_dim=64, num_pages=16)  # fmt: skip
    if tokens:
        c.access_tokens.add(name="scheduler", token="sched-token", methods=["*"])
        c.access_tokens.add(name="dashboard", token="read-token", methods=["GetServerInfo"])
    return c


def credentials(pki: dict[str, Path], root: str = "ca", client: str | None = None):
    key = pki[f"{client}_key"].read_bytes() if client else None
    cert = pki[f"{client}_cert"].read_bytes() if client else None
    return grpc.ssl_channel_credentials(pki[root].read_bytes(), key, cert)


def localhost(server: Launched) -> str:
    return "localhost:" + server.address.rsplit(":", 1)[1]  # the name the certificate holds


def test_tls_serves_trusting_clients_only(pki, private) -> None:
    server = private(config(), f"--tls_cert_file={pki['server_cert']}",
                     f"--tls_key_file={pki['server_key']}")  # fmt: skip
    with Client(localhost(server), credentials=credentials(pki), retry=None) as good:
        assert good.server_info().pools[0].name == "p"
    with Client(localhost(server), credentials=credentials(pki, "other_ca"), retry=None,
                timeout=5, wait_for_ready=False) as wrong_ca:  # fmt: skip
        with pytest.raises(Unavailable):
            wrong_ca.server_info()
    with Client(localhost(server), retry=None, timeout=5, wait_for_ready=False) as plaintext:
        with pytest.raises(Unavailable):
            plaintext.server_info()


def test_mutual_tls_needs_a_client_certificate_from_the_ca(pki, private) -> None:
    server = private(config(), f"--tls_cert_file={pki['server_cert']}",
                     f"--tls_key_file={pki['server_key']}",
                     f"--tls_client_ca_file={pki['ca']}")  # fmt: skip
    with Client(localhost(server), credentials=credentials(pki, client="client"),
                retry=None) as good:  # fmt: skip
        assert good.allocate_pages(2, pool="p")
    for who in (None, "rogue"):  # no certificate; a certificate of another CA
        with Client(localhost(server), credentials=credentials(pki, client=who), retry=None,
                    timeout=5, wait_for_ready=False) as bad:  # fmt: skip
            with pytest.raises(Unavailable):
                bad.server_info()


def test_a_session_belongs_to_the_client_certificate_that_opened_it(pki, private) -> None:
    """Without tokens, mutual TLS names the caller: another certificate of the same CA holding
    the handle may not use the session."""
    server = private(config(), f"--tls_cert_file={pki['server_cert']}",
                     f"--tls_key_file={pki['server_key']}",
                     f"--tls_client_ca_file={pki['ca']}")  # fmt: skip
    with Client(localhost(server), credentials=credentials(pki, client="client"),
                retry=None) as owner:  # fmt: skip
        pages = owner.allocate_pages(2, pool="p")
        with Client(localhost(server), credentials=credentials(pki, client="other"),
                    session=owner.session, retry=None) as other:  # fmt: skip
            with pytest.raises(PermissionDenied):
                other.free_pages(pages, pool="p")
        with Client(localhost(server), credentials=credentials(pki, client="client"),
                    session=owner.session, retry=None) as again:  # fmt: skip
            again.free_pages(pages, pool="p")  # the same certificate, another connection


def test_bearer_tokens_and_method_permissions(private) -> None:
    server = private(config(tokens=True))
    with Client(server.address, retry=None) as anonymous:
        with pytest.raises(Unauthenticated):
            anonymous.server_info()
    with Client(server.address, token="wrong", retry=None) as wrong:
        with pytest.raises(Unauthenticated):
            wrong.server_info()
    with Client(server.address, token="read-token", retry=None) as dashboard:
        assert dashboard.server_info().pools[0].total_pages == 16
        with pytest.raises(PermissionDenied):
            dashboard.allocate_pages(1, pool="p")
    with Client(server.address, token="sched-token", retry=None) as scheduler:
        pages = scheduler.allocate_pages(3, pool="p")
        scheduler.free_pages(pages, pool="p")


def test_health_on_a_plaintext_port_when_tls_is_on(pki, private) -> None:
    port = free_port()
    private(config(tokens=True), f"--tls_cert_file={pki['server_cert']}",
            f"--tls_key_file={pki['server_key']}", f"--health_port={port}")  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=5)
    assert reply == b"\x08\x01"  # SERVING
