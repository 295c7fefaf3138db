"""The index client honours pip's TLS settings and a simple page's ``<base href>``.

A real HTTPS index on loopback whose certificate comes from a CA made here, known only to
pip's configuration (a PIP_CONFIG_FILE this test writes): `fetch` fails with a message
naming the TLS problem and where to configure it, then downloads through pip's ``cert``; a
server that asks for a client certificate gets pip's ``client-cert``.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from synthetic import IndexServer
from vllm_overlay.index.client import Page, parse_page
from vllm_overlay.overlay.project import Project

SDIST = "vllm-1.0.0.tar.gz"


@dataclass(frozen=True)
class PKI:
    ca: Path  # the CA certificate (what pip's `cert` names)
    server: Path  # the server's certificate chain and key
    client: Path  # a client certificate and its key, one PEM (what `client-cert` names)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(subject: str, key, issuer: str, issuer_key, *, ca: bool = False, san=None, usage=None):
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
        )
        b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    else:
        b = b.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pem(cert, key=None) -> bytes:
    out = cert.public_bytes(serialization.Encoding.PEM)
    if key is not None:
        out += key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    return out


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in "abc")
    ca = _issue("test index CA", ca_key, "test index CA", ca_key, ca=True)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = _issue("127.0.0.1", server_key, "test index CA", ca_key, san=san,
                    usage=ExtendedKeyUsageOID.SERVER_AUTH)  # fmt: skip
    client = _issue("reader", client_key, "test index CA", ca_key,
                    usage=ExtendedKeyUsageOID.CLIENT_AUTH)  # fmt: skip
    p = PKI(d / "ca.pem", d / "server.pem", d / "client.pem")
    p.ca.write_bytes(_pem(ca))
    p.server.write_bytes(_pem(server, server_key))
    p.client.write_bytes(_pem(client, client_key))
    return p


def server_context(pki: PKI, *, client_certs: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.server)
    if client_certs:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pki.ca)
        # TLS 1.2: a refused client certificate fails the handshake itself, not a later read
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    return ctx


@pytest.fixture
def pip_conf(tmp_path, monkeypatch):
    """Write pip's configuration (PIP_CONFIG_FILE) with ``[global]`` ``settings``; pip's TLS
    variables from the machine are dropped so the file is the only place pip is told."""
    monkeypatch.delenv("PIP_CERT", raising=False)
    monkeypatch.delenv("PIP_CLIENT_CERT", raising=False)
    path = tmp_path / "pip.conf"
    monkeypatch.setenv("PIP_CONFIG_FILE", str(path))

    def write(**settings: str) -> None:
        lines = [f"{k.replace('_', '-')} = {v}" for k, v in settings.items()]
        path.write_text("[global]\n" + "\n".join(lines) + "\n")

    return write


def cached_sdist(project) -> Path | None:
    found = list((Path(os.environ["VLLM_OVERLAY_CACHE"]) / "artifacts").rglob(SDIST))
    return found[0] if found else None


def pinned_sha256(project) -> str:
    return Project(project.root).lock().sdist().sha256


def test_fetch_trusts_the_ca_pip_is_configured_with(project, pki, pip_conf, cli):
    dist = project.upstream.repo.parent / "dist"
    with IndexServer(dist, tls=server_context(pki)) as srv:
        pip_conf(index_url=srv.url, extra_index_url="")
        res = cli("fetch", cwd=project.root)
        assert res.rc == 1
        assert f"the TLS connection to the package index at {srv.root}/simple/vllm/" in res.err
        assert "CERTIFICATE_VERIFY_FAILED" in res.err, res.err
        # what it verified with: the machine's own pip.conf may name the system bundle
        assert "verifying with the system's CA certificates" in res.err or (
            "(pip's cert)" in res.err and str(pki.ca) not in res.err
        )
        assert "`cert = /path/ca.pem` under [global] in pip.conf" in res.err
        assert "PIP_CERT" in res.err and "Traceback" not in res.err
        assert cached_sdist(project) is None

        pip_conf(index_url=srv.url, extra_index_url="", cert=str(pki.ca))
        res = cli("fetch", cwd=project.root)
        assert res.rc == 0, res.err
    got = cached_sdist(project)
    assert got is not None
    assert hashlib.sha256(got.read_bytes()).hexdigest() == pinned_sha256(project)
    assert srv.requests == ["/simple/vllm/", f"/files/{SDIST}"]


def test_a_server_asking_for_a_client_certificate_gets_pips(
    project, pki, pip_conf, cli, monkeypatch
):
    dist = project.upstream.repo.parent / "dist"
    with IndexServer(dist, tls=server_context(pki, client_certs=True)) as srv:
        pip_conf(index_url=srv.url, extra_index_url="", cert=str(pki.ca))
        res = cli("fetch", cwd=project.root)
        assert res.rc == 1
        assert "the TLS connection to the package index" in res.err, res.err
        assert f"verifying with CA bundle {pki.ca} (pip's cert)" in res.err
        assert "PIP_CLIENT_CERT names one PEM file" in res.err
        assert srv.requests == []  # refused in the handshake: no request reached it
        assert cached_sdist(project) is None

        monkeypatch.setenv("PIP_CLIENT_CERT", str(pki.client))
        res = cli("fetch", cwd=project.root)
        assert res.rc == 0, res.err
    got = cached_sdist(project)
    assert got is not None
    assert hashlib.sha256(got.read_bytes()).hexdigest() == pinned_sha256(project)


def test_an_unreadable_cert_setting_is_named(project, pki, pip_conf, cli, tmp_path):
    with IndexServer(project.upstream.repo.parent / "dist", tls=server_context(pki)) as srv:
        pip_conf(index_url=srv.url, extra_index_url="", cert=str(tmp_path / "missing.pem"))
        res = cli("fetch", cwd=project.root)
    assert res.rc == 1
    assert f"pip's `cert` setting names {tmp_path / 'missing.pem'}" in res.err, res.err
    assert "Fix `cert` in pip.conf or PIP_CERT" in res.err


def test_fetch_follows_a_pages_base_href(project, cli):
    """The project page says <base href="/files/"> and links bare file names: they are
    files there, not under the page's own directory (which has none)."""
    with IndexServer(project.upstream.repo.parent / "dist", base_href="/files/") as srv:
        res = cli("fetch", "--index-url", srv.url, cwd=project.root)
    assert res.rc == 0, res.err
    assert srv.requests == ["/simple/vllm/", f"/files/{SDIST}"]
    got = cached_sdist(project)
    assert got is not None
    assert hashlib.sha256(got.read_bytes()).hexdigest() == pinned_sha256(project)


@pytest.mark.parametrize(
    ("head", "href", "url"),
    [
        ("", "x-1.0.tar.gz", "https://idx.test/simple/x/x-1.0.tar.gz"),
        ('<base href="../../files/">', "x-1.0.tar.gz", "https://idx.test/files/x-1.0.tar.gz"),
        (
            '<base href="https://cdn.test/p/">',
            "a/x-1.0.tar.gz",
            "https://cdn.test/p/a/x-1.0.tar.gz",
        ),
        ('<base href="https://cdn.test/p/">', "/x-1.0.tar.gz", "https://cdn.test/x-1.0.tar.gz"),
        (
            '<base target="_top"><base href="/f/">',
            "x-1.0.tar.gz",
            "https://idx.test/f/x-1.0.tar.gz",
        ),
        ('<base href="/f/"><base href="/g/">', "x-1.0.tar.gz", "https://idx.test/f/x-1.0.tar.gz"),
    ],
)
def test_links_resolve_against_base_href_else_the_page(head, href, url):
    body = f'<html><head>{head}</head><body><a href="{href}#sha256=AB">x-1.0.tar.gz</a>'
    (f,) = parse_page(Page("https://idx.test/simple/x/", "text/html", body.encode()))
    assert (f.filename, f.url, f.sha256) == ("x-1.0.tar.gz", url, "ab")


def test_uv_is_handed_pips_tls_settings(pki, pip_conf, monkeypatch):
    """The installs (uv) trust what the index client trusts: pip's
    ``cert`` and ``client-cert`` become uv's SSL_CERT_FILE / SSL_CLIENT_CERT."""
    from vllm_overlay.envs.installer import Installer

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CLIENT_CERT", raising=False)
    pip_conf(cert=str(pki.ca), client_cert=str(pki.client))
    env = Installer("uv").env({})
    assert env["SSL_CERT_FILE"] == str(pki.ca)
    assert env["SSL_CLIENT_CERT"] == str(pki.client)
    # a variable the caller set wins over pip's configuration
    assert Installer("uv").env({"SSL_CERT_FILE": "/elsewhere.pem"})["SSL_CERT_FILE"] == (
        "/elsewhere.pem"
    )
