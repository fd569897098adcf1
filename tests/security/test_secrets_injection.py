"""Finding 8, the injection path: a secret goes only to the hosts its patterns name, and only over
TLS verified for that host. A real gateway; upstreams on loopback with certificates from a CA the
gateway trusts (for the right names and for others) and from one it does not."""

from __future__ import annotations

import datetime as dt
import http.client
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.gateway.harness import GATEWAY_PY, HOSTS, SB1, Gateway, Upstream, UpstreamPKI

TOKEN = "Bearer sk-inject-0123456789abcdef"
NAMES = {"api.test", "a.svc.test", "svc.test", "evilsvc.test", "a.svc.test.evil.test"}


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(d: Path, cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path]:
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(hours=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    path = d / f"{cn.replace(' ', '-')}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, path


def _leaf(d: Path, ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate, Path], names: list[str],
          tag: str) -> UpstreamPKI:
    ca_key, ca_cert, ca_path = ca
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    cert = (x509.CertificateBuilder().subject_name(_name(names[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    leaf, leaf_key = d / f"{tag}.pem", d / f"{tag}-key.pem"
    leaf.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    leaf_key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return UpstreamPKI(ca_path, leaf, leaf_key)


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> dict[str, UpstreamPKI]:
    d = tmp_path_factory.mktemp("pki")
    trusted, stranger = _ca(d, "trusted upstream CA"), _ca(d, "untrusted CA")
    return {"right": _leaf(d, trusted, sorted(NAMES), "right"),
            "wrong_name": _leaf(d, trusted, ["wrong.test"], "wrong-name"),
            "untrusted": _leaf(d, stranger, sorted(NAMES), "untrusted")}


@pytest.fixture(scope="module")
def upstreams(pkis: dict[str, UpstreamPKI]) -> Iterator[dict[str, Upstream]]:
    ups = {"plain": Upstream(None), **{k: Upstream(p) for k, p in pkis.items()}}
    yield ups
    for u in ups.values():
        u.close()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pkis: dict[str, UpstreamPKI]) -> Iterator[Gateway]:
    if not GATEWAY_PY.exists():
        pytest.skip("the gateway venv is missing: run `make gateway`")
    hosts = {**HOSTS, **dict.fromkeys(NAMES, "127.0.0.1")}
    g = Gateway(tmp_path_factory.mktemp("gw"), pkis["right"], hosts=hosts)  # trusts the "trusted" CA only
    try:
        g.start()
        yield g
    finally:
        g.stop()


@pytest.fixture
def secret_for(gw: Gateway) -> Iterator[None]:
    gw.put(SB1, {"allow": ["127.0.0.0/8", *sorted(NAMES)]},
           [{"name": "tok", "secret_id": "sec-tok", "hosts": ["api.test", "*.svc.test"], "header": "Authorization",
             "value": TOKEN, "expires_at": None, "rate_limit": None}])
    yield
    gw.ctl({"op": "delete", "ip": SB1})


def _carried_token(up: Upstream, since: int) -> bool:
    return any(h["headers"].get("authorization") == TOKEN for h in up.hits[since:])


@pytest.mark.usefixtures("secret_for")
def test_injected_for_the_named_host_and_its_subdomains_only(gw: Gateway, upstreams: dict[str, Upstream]) -> None:
    up = upstreams["right"]
    for host, injected in (("api.test", True), ("a.svc.test", True), ("svc.test", False), ("evilsvc.test", False),
                           ("a.svc.test.evil.test", False)):
        since = len(up.hits)
        status, _, _, issuer = gw.https(SB1, host, up.port)
        assert status == 200, host
        assert _carried_token(up, since) is injected, host
        # Intercepted only where a secret goes: elsewhere the sandbox sees the upstream's own certificate.
        assert issuer == ("SPACE egress CA" if injected else "trusted upstream CA"), host


@pytest.mark.usefixtures("secret_for")
def test_never_over_plain_http(gw: Gateway, upstreams: dict[str, Upstream]) -> None:
    up = upstreams["plain"]
    since = len(up.hits)
    resp = gw.http(SB1, f"http://api.test:{up.port}/echo")
    assert resp.status == 200 and len(up.hits) == since + 1
    assert not _carried_token(up, since)


@pytest.mark.parametrize("which", ["untrusted", "wrong_name"])
@pytest.mark.usefixtures("secret_for")
def test_never_to_an_upstream_whose_certificate_does_not_verify(gw: Gateway, upstreams: dict[str, Upstream],
                                                                which: str) -> None:
    up = upstreams[which]
    since = len(up.hits)
    conn = http.client.HTTPSConnection("127.0.0.1", gw.proxy_port, timeout=10, source_address=(SB1, 0),
                                       context=gw.client_context())
    conn.set_tunnel("api.test", up.port)
    try:
        conn.request("GET", "/echo")
        resp = conn.getresponse()
        status, body = resp.status, resp.read()
    except OSError:
        status, body = 0, b""  # the gateway may as well close the tunnel
    finally:
        conn.close()
    assert status == 502 or status == 0, (status, body)
    assert up.hits[since:] == []  # no request reached it at all, so neither did the credential
