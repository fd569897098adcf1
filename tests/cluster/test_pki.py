"""The cluster PKI (space.cluster.pki): what the CA issues, and what mutual TLS over real loopback
sockets accepts and refuses with it (no mocks: OpenSSL decides)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import socket
import ssl
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, ExtensionOID, NameOID

from space.cluster import pki
from space.cluster.pki import (
    MAX_CSR_BYTES,
    ClusterCA,
    PKIError,
    client_context,
    make_key_and_csr,
    node_id_of,
    server_context,
    write_private,
)

#: Bounds every blocking socket call, so that a bug hangs no test: a timeout is a failure, never a refusal.
TIMEOUT = 10.0
PAYLOAD = b"ping"
HOSTS = ("127.0.0.1", "localhost")
#: OpenSSL's X509_V_ERR_INVALID_PURPOSE: "unsuitable certificate purpose" (3.x; 1.1 said "unsupported").
X509_V_ERR_INVALID_PURPOSE = 26


# ---- a real TLS round trip over loopback ----------------------------------------------------------


@dataclass
class Outcome:
    """One connection: what the client got back, and what each side raised."""

    reply: bytes = b""
    client_error: OSError | None = None
    server_error: BaseException | None = None
    server_peer_cn: str | None = None
    client_peer_der: bytes | None = None
    served: threading.Event = field(default_factory=threading.Event)

    @property
    def completed(self) -> bool:
        return self.reply == PAYLOAD


def _serve_one(listener: socket.socket, ctx: ssl.SSLContext, out: Outcome) -> None:
    """Accept one connection, handshake, echo one message back."""
    try:
        conn, _ = listener.accept()
        conn.settimeout(TIMEOUT)
        with ctx.wrap_socket(conn, server_side=True) as tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            cn = x509.load_der_x509_certificate(der).subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
            out.server_peer_cn = str(cn)
            data = b""
            while len(data) < len(PAYLOAD) and (chunk := tls.recv(64)):
                data += chunk
            tls.sendall(data)
            out.served.set()
    except BaseException as e:
        out.server_error = e


def round_trip(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, server_hostname: str) -> Outcome:
    """Connect ``client_ctx`` to a server on ``server_ctx`` at 127.0.0.1, send ``PAYLOAD``, read the echo."""
    out = Outcome()
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        listener.settimeout(TIMEOUT)
        thread = threading.Thread(target=_serve_one, args=(listener, server_ctx, out), daemon=True)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname()[:2], timeout=TIMEOUT) as raw:
                try:
                    with client_ctx.wrap_socket(raw, server_hostname=server_hostname) as tls:
                        out.client_peer_der = tls.getpeercert(binary_form=True)
                        tls.sendall(PAYLOAD)
                        while len(out.reply) < len(PAYLOAD) and (chunk := tls.recv(64)):
                            out.reply += chunk
                except TimeoutError:
                    raise
                except OSError as e:  # ssl.SSLError, ConnectionResetError, BrokenPipeError
                    out.client_error = e
        finally:
            thread.join(TIMEOUT)
        assert not thread.is_alive(), "the server thread did not finish"
    finally:
        listener.close()
    return out


def assert_round_trip(out: Outcome) -> None:
    assert out.server_error is None, out.server_error
    assert out.client_error is None, out.client_error
    assert out.completed and out.served.is_set()


def assert_refused(out: Outcome) -> None:
    """A refusal is "the client cannot complete a request/response round trip", whichever way it shows.

    Where the server refuses the client's certificate, the client may see it as an SSLError from the
    handshake, a ConnectionResetError or BrokenPipeError, or a plain EOF on its first read: in TLS 1.3
    the client's handshake is over once it has sent its certificate and Finished, and the server's
    verdict arrives afterwards, as an alert (or a reset) where the reply would have been.
    """
    assert not out.completed, "the round trip completed"
    assert not out.served.is_set(), "the server echoed"


def server_reason(out: Outcome) -> str:
    """The server's refusal, as text (verify_message for a certificate that did not verify)."""
    assert out.server_error is not None, "the server did not refuse"
    err = out.server_error
    return f"{err} {getattr(err, 'verify_message', '')}"


def client_reason(out: Outcome) -> str:
    assert out.client_error is not None, "the client did not refuse"
    err = out.client_error
    return f"{err} {getattr(err, 'verify_message', '')}"


# ---- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(params=[ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3], ids=["tls1.2", "tls1.3"])
def tls_version(request: pytest.FixtureRequest) -> ssl.TLSVersion:
    version: ssl.TLSVersion = request.param
    return version


@pytest.fixture
def ca() -> ClusterCA:
    return ClusterCA.create()


@pytest.fixture
def other_ca() -> ClusterCA:
    return ClusterCA.create("another cluster CA")


def node_cert(ca: ClusterCA, node_id: str = "n1", hosts: Sequence[str] = HOSTS) -> tuple[bytes, bytes]:
    """(cert_pem, key_pem) of a node joined the way a node joins: its own key, a CSR, the CA's signature."""
    key, csr = make_key_and_csr(node_id)
    return ca.sign_node(csr, node_id=node_id, hosts=hosts), key


def files(tmp_path: Path, cert: bytes, key: bytes, ca_pem: bytes) -> tuple[Path, Path, Path]:
    d = tmp_path / secrets.token_hex(4)
    d.mkdir()
    paths = d / "cert.pem", d / "key.pem", d / "ca.pem"
    for p, data in zip(paths, (cert, key, ca_pem), strict=True):
        write_private(p, data)
    return paths


def node_server(tmp_path: Path, ca: ClusterCA, cert_and_key: tuple[bytes, bytes] | None = None,
                trusted: ClusterCA | None = None) -> ssl.SSLContext:
    cert, key = cert_and_key or node_cert(ca)
    return server_context(*files(tmp_path, cert, key, (trusted or ca).cert_pem))


def control_plane(ca: ClusterCA, version: ssl.TLSVersion, *, trusted: ClusterCA | None = None,
                  name: str = "api-1") -> ssl.SSLContext:
    ctx = client_context(*ca.issue_client(name), (trusted or ca).cert_pem)
    ctx.maximum_version = version
    return ctx


# ---- 1. the control plane calls a node ------------------------------------------------------------


@pytest.mark.parametrize("host", HOSTS)
def test_control_plane_calls_node(tmp_path: Path, ca: ClusterCA, tls_version: ssl.TLSVersion, host: str) -> None:
    out = round_trip(node_server(tmp_path, ca), control_plane(ca, tls_version), host)
    assert_round_trip(out)
    # Each side knows who the other is from the certificate alone.
    assert out.server_peer_cn == "control-plane:api-1"
    assert out.client_peer_der is not None
    assert node_id_of(ssl.DER_cert_to_PEM_cert(out.client_peer_der).encode()) == "n1"


# ---- 2.-6. what the handshake refuses -------------------------------------------------------------


def test_client_without_certificate_refused(tmp_path: Path, ca: ClusterCA, tls_version: ssl.TLSVersion) -> None:
    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.load_verify_locations(cadata=ca.cert_pem.decode())
    anonymous.maximum_version = tls_version
    out = round_trip(node_server(tmp_path, ca), anonymous, "127.0.0.1")
    assert_refused(out)
    assert "PEER_DID_NOT_RETURN_A_CERTIFICATE" in server_reason(out)


def test_client_certificate_from_another_ca_refused(tmp_path: Path, ca: ClusterCA, other_ca: ClusterCA,
                                                   tls_version: ssl.TLSVersion) -> None:
    # Issued by the other CA, trusting ours for the server (which it is).
    out = round_trip(node_server(tmp_path, ca), control_plane(other_ca, tls_version, trusted=ca), "127.0.0.1")
    assert_refused(out)
    assert out.server_error is not None


def test_server_certificate_from_another_ca_refused(tmp_path: Path, ca: ClusterCA, other_ca: ClusterCA,
                                                   tls_version: ssl.TLSVersion) -> None:
    # A node of the other cluster, which would even trust our control plane.
    server = node_server(tmp_path, other_ca, trusted=ca)
    out = round_trip(server, control_plane(ca, tls_version), "127.0.0.1")
    assert_refused(out)
    assert isinstance(out.client_error, ssl.SSLCertVerificationError)
    assert "unable to get local issuer certificate" in client_reason(out)


def test_node_certificate_refused_as_client(tmp_path: Path, ca: ClusterCA, tls_version: ssl.TLSVersion) -> None:
    """A compromised node cannot drive its peers: its certificate (serverAuth only, from the same CA)
    is refused as a client certificate by OpenSSL's default ``ssl_client`` purpose check, during the
    handshake, with nothing configured for it in server_context."""
    peer = node_server(tmp_path, ca, node_cert(ca, "n2"))
    rogue = client_context(*node_cert(ca, "n1"), ca.cert_pem)
    rogue.maximum_version = tls_version
    out = round_trip(peer, rogue, "127.0.0.1")
    assert_refused(out)
    assert isinstance(out.server_error, ssl.SSLCertVerificationError)
    assert out.server_error.verify_code == X509_V_ERR_INVALID_PURPOSE, server_reason(out)
    assert out.server_peer_cn is None  # the server never got as far as a connection


def test_control_plane_certificate_refused_as_server(tmp_path: Path, ca: ClusterCA,
                                                     tls_version: ssl.TLSVersion) -> None:
    """A control-plane key cannot impersonate a node: its certificate (clientAuth only) is refused as a
    server certificate by the ``ssl_server`` purpose check, before the host name is looked at."""
    impostor = node_server(tmp_path, ca, ca.issue_client("controller"))
    out = round_trip(impostor, control_plane(ca, tls_version), "127.0.0.1")
    assert_refused(out)
    assert isinstance(out.client_error, ssl.SSLCertVerificationError)
    assert out.client_error.verify_code == X509_V_ERR_INVALID_PURPOSE, client_reason(out)


@pytest.mark.parametrize(("host", "reason"), [("node-2.example", "Hostname mismatch"),
                                              ("127.0.0.2", "IP address mismatch")])
def test_host_name_mismatch_refused(tmp_path: Path, ca: ClusterCA, tls_version: ssl.TLSVersion,
                                    host: str, reason: str) -> None:
    out = round_trip(node_server(tmp_path, ca), control_plane(ca, tls_version), host)
    assert_refused(out)
    assert isinstance(out.client_error, ssl.SSLCertVerificationError)
    assert reason in client_reason(out)


# ---- 7. what sign_node issues, and refuses --------------------------------------------------------


PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def _csr(key: PrivateKey, builder: x509.CertificateSigningRequestBuilder | None = None, cn: str = "n1") -> bytes:
    builder = builder or x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_node_certificate_contents(ca: ClusterCA) -> None:
    cert_pem, key_pem = node_cert(ca, "n1", ["10.0.0.5", "Node1.Cluster.Internal", "::1", "10.0.0.5"])
    cert = x509.load_pem_x509_certificate(cert_pem)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP256R1)
    assert cert.public_key() == key.public_key()
    assert cert.issuer == ca_cert.subject
    assert cert.subject.rfc4514_string() == "O=space,CN=node:n1"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    # Its identity name first (what the control plane checks it against), then its hosts.
    assert list(san) == [x509.DNSName(pki.identity_name("n1")), x509.IPAddress(ipaddress.ip_address("10.0.0.5")),
                         x509.DNSName("node1.cluster.internal"), x509.IPAddress(ipaddress.ip_address("::1"))]
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and ku.value.key_agreement and not ku.value.key_encipherment
    assert not ku.value.key_cert_sign
    aki = cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    now = datetime.datetime.now(datetime.UTC)
    assert now - datetime.timedelta(minutes=6) < cert.not_valid_before_utc < now - datetime.timedelta(minutes=4)
    assert cert.not_valid_after_utc - now > datetime.timedelta(days=364)
    assert cert.serial_number != x509.load_pem_x509_certificate(node_cert(ca)[0]).serial_number
    cert.verify_directly_issued_by(ca_cert)


def test_sign_node_ignores_what_the_csr_asks_for(ca: ClusterCA) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    greedy = (x509.CertificateSigningRequestBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "control-plane:evil")]))
              .add_extension(x509.SubjectAlternativeName([x509.DNSName("evil.example")]), critical=False)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
              .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True))
    cert = x509.load_pem_x509_certificate(ca.sign_node(_csr(key, greedy), node_id="n1", hosts=["10.0.0.5"]))
    assert cert.subject.rfc4514_string() == "O=space,CN=node:n1"
    assert list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value) == [
        x509.DNSName(pki.identity_name("n1")), x509.IPAddress(ipaddress.ip_address("10.0.0.5"))]
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert {e.oid for e in cert.extensions} == {
        ExtensionOID.BASIC_CONSTRAINTS, ExtensionOID.KEY_USAGE, ExtensionOID.EXTENDED_KEY_USAGE,
        ExtensionOID.AUTHORITY_KEY_IDENTIFIER, ExtensionOID.SUBJECT_KEY_IDENTIFIER,
        ExtensionOID.SUBJECT_ALTERNATIVE_NAME}
    assert b"evil" not in cert.public_bytes(serialization.Encoding.DER)
    assert node_id_of(cert.public_bytes(serialization.Encoding.PEM)) == "n1"


def test_sign_node_refuses_a_broken_signature(ca: ClusterCA) -> None:
    _, csr_pem = make_key_and_csr("n1")
    csr = x509.load_pem_x509_csr(csr_pem)
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    at = der.rindex(csr.signature) + len(csr.signature) - 1
    der[at] ^= 0x01
    broken = x509.load_der_x509_csr(bytes(der))
    assert not broken.is_signature_valid
    with pytest.raises(PKIError, match="signature does not verify"):
        ca.sign_node(broken.public_bytes(serialization.Encoding.PEM), node_id="n1", hosts=HOSTS)


def test_sign_node_refuses_an_oversized_csr(ca: ClusterCA) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName(f"host-{i}.example.internal") for i in range(800)]
    big = _csr(key, x509.CertificateSigningRequestBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "n1")]))
               .add_extension(x509.SubjectAlternativeName(names), critical=False))
    assert len(big) > MAX_CSR_BYTES
    assert x509.load_pem_x509_csr(big).is_signature_valid  # a real CSR: it is its size that is refused
    with pytest.raises(PKIError, match="at most"):
        ca.sign_node(big, node_id="n1", hosts=HOSTS)


@pytest.mark.parametrize("csr", [b"", b"not a csr", b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n"
                                 b"-----END CERTIFICATE REQUEST-----\n"])
def test_sign_node_refuses_garbage(ca: ClusterCA, csr: bytes) -> None:
    with pytest.raises(PKIError, match="CSR"):
        ca.sign_node(csr, node_id="n1", hosts=HOSTS)


@pytest.mark.parametrize("host", ["a b", "*.x", "", "-x.com", "x-.com", "a..b", "x.com.", "under_score.com",
                                  "1.2.3", "a" * 64 + ".com", ".".join(["a" * 63] * 4), "fe80::1%eth0",
                                  "ex\u00e4mple.com", "\u212aubernetes", "localhost\n"])
def test_sign_node_refuses_bad_hosts(ca: ClusterCA, host: str) -> None:
    _, csr = make_key_and_csr("n1")
    with pytest.raises(PKIError, match="host"):
        ca.sign_node(csr, node_id="n1", hosts=["10.0.0.1", host])


@pytest.mark.parametrize("hosts", [[], "localhost"])
def test_sign_node_needs_a_list_of_hosts(ca: ClusterCA, hosts: Sequence[str]) -> None:
    _, csr = make_key_and_csr("n1")
    with pytest.raises(PKIError, match="host"):
        ca.sign_node(csr, node_id="n1", hosts=hosts)


@pytest.mark.parametrize("node_id", ["", "node:x", "a b", "x" * 51, "-x", "\u00e9"])
def test_sign_node_refuses_bad_node_ids(ca: ClusterCA, node_id: str) -> None:
    _, csr = make_key_and_csr("n1")
    with pytest.raises(PKIError, match="node id"):
        ca.sign_node(csr, node_id=node_id, hosts=HOSTS)


@pytest.mark.parametrize(("key", "reason"), [
    (lambda: rsa.generate_private_key(65537, 1024), "RSA key of 1024 bits"),
    (lambda: ec.generate_private_key(ec.SECP384R1()), "only P-256"),
])
def test_sign_node_refuses_weak_or_unknown_keys(ca: ClusterCA, key: Callable[[], PrivateKey], reason: str) -> None:
    with pytest.raises(PKIError, match=reason):
        ca.sign_node(_csr(key()), node_id="n1", hosts=HOSTS)


def test_sign_node_accepts_rsa_2048(tmp_path: Path, ca: ClusterCA) -> None:
    key = rsa.generate_private_key(65537, 2048)
    cert_pem = ca.sign_node(_csr(key), node_id="n1", hosts=HOSTS)
    ku = x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and ku.key_encipherment and not ku.key_agreement
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    out = round_trip(node_server(tmp_path, ca, (cert_pem, key_pem)), control_plane(ca, ssl.TLSVersion.TLSv1_3),
                     "localhost")
    assert_round_trip(out)


def test_client_certificate_contents(ca: ClusterCA) -> None:
    cert_pem, key_pem = ca.issue_client("controller-1", days=7)
    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert cert.public_key() == key.public_key()
    assert cert.subject.rfc4514_string() == "O=space,CN=control-plane:controller-1"
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    with pytest.raises(x509.ExtensionNotFound):
        cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    assert cert.not_valid_after_utc - cert.not_valid_before_utc < datetime.timedelta(days=7, minutes=6)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_pem))
    with pytest.raises(PKIError, match="not a node certificate"):
        node_id_of(cert_pem)


def test_leaf_lifetime_ends_with_the_ca() -> None:
    ca = ClusterCA.create(days=10)
    cert = x509.load_pem_x509_certificate(node_cert(ca)[0])
    assert cert.not_valid_after_utc == x509.load_pem_x509_certificate(ca.cert_pem).not_valid_after_utc


# ---- 8. the CA itself, node_id_of -----------------------------------------------------------------


def test_ca_certificate(ca: ClusterCA) -> None:
    cert = x509.load_pem_x509_certificate(ca.cert_pem)
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign and not ku.value.digital_signature
    cert.verify_directly_issued_by(cert)
    assert ca.fingerprint == cert.fingerprint(hashes.SHA256()).hex() and len(ca.fingerprint) == 64
    assert ca.key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    assert b"PRIVATE" not in repr(ca).encode()
    assert ClusterCA.create().fingerprint != ca.fingerprint


def test_ca_load_round_trip(ca: ClusterCA) -> None:
    assert ClusterCA.load(ca.cert_pem, ca.key_pem) == ca
    # Another PEM encoding of the same key comes back as PKCS8.
    key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    sec1 = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())
    assert ClusterCA.load(ca.cert_pem, sec1).key_pem == ca.key_pem


def test_ca_load_refuses_a_mismatched_key(ca: ClusterCA, other_ca: ClusterCA) -> None:
    with pytest.raises(PKIError, match="does not match"):
        ClusterCA.load(ca.cert_pem, other_ca.key_pem)


def test_ca_load_refuses_a_non_ca_certificate(ca: ClusterCA) -> None:
    cert, key = node_cert(ca)
    with pytest.raises(PKIError, match="not a CA"):
        ClusterCA.load(cert, key)
    with pytest.raises(PKIError, match="not a CA"):
        ClusterCA.load(*ca.issue_client("api-1"))


def test_ca_load_refuses_garbage_and_encrypted_keys(ca: ClusterCA) -> None:
    with pytest.raises(PKIError, match="not a PEM certificate"):
        ClusterCA.load(b"garbage", ca.key_pem)
    with pytest.raises(PKIError, match="not a PEM private key"):
        ClusterCA.load(ca.cert_pem, b"garbage")
    key = serialization.load_pem_private_key(ca.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    encrypted = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.BestAvailableEncryption(b"secret"))
    with pytest.raises(PKIError, match="encrypted"):
        ClusterCA.load(ca.cert_pem, encrypted)


def test_node_id_of(ca: ClusterCA) -> None:
    for node_id in ("n1", "node-1", "rack2.node_07"):
        assert node_id_of(node_cert(ca, node_id)[0]) == node_id
    with pytest.raises(PKIError, match="not a node certificate"):
        node_id_of(ca.cert_pem)
    with pytest.raises(PKIError, match="not a PEM certificate"):
        node_id_of(b"garbage")


def test_make_key_and_csr() -> None:
    key_pem, csr_pem = make_key_and_csr("n1")
    csr = x509.load_pem_x509_csr(csr_pem)
    assert csr.is_signature_valid
    assert csr.subject.rfc4514_string() == "CN=n1"
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and csr.public_key() == key.public_key()
    assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")


# ---- contexts and files ---------------------------------------------------------------------------


def test_contexts(tmp_path: Path, ca: ClusterCA) -> None:
    server = node_server(tmp_path, ca)
    assert server.verify_mode == ssl.CERT_REQUIRED and server.minimum_version == ssl.TLSVersion.TLSv1_2
    client = client_context(*ca.issue_client("api-1"), ca.cert_pem)
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    assert client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert [c["subject"] for c in client.get_ca_certs()] == [c["subject"] for c in server.get_ca_certs()]


def test_client_context_refuses_a_mismatched_key(ca: ClusterCA) -> None:
    cert, _ = ca.issue_client("api-1")
    _, other_key = ca.issue_client("api-2")
    with pytest.raises(PKIError, match="does not load"):
        client_context(cert, other_key, ca.cert_pem)
    with pytest.raises(PKIError, match="CA certificate"):
        client_context(cert, other_key, b"garbage")


def test_server_context_refuses_a_mismatched_key(tmp_path: Path, ca: ClusterCA) -> None:
    cert, _ = node_cert(ca)
    _, other_key = node_cert(ca)
    with pytest.raises(PKIError, match="node TLS files"):
        server_context(*files(tmp_path, cert, other_key, ca.cert_pem))


def test_temp_pem_file_fallback(ca: ClusterCA) -> None:
    """The fallback for systems without memfd_create: a 0600 file in a private directory, gone after."""
    cert, key = ca.issue_client("api-1")
    with pki._temp_pem_file(cert + key) as path:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_cert_chain(path)
    assert not os.path.exists(os.path.dirname(path))


def _dir_entries(d: Path) -> Iterator[str]:
    return (p.name for p in d.iterdir())


def test_write_private(tmp_path: Path) -> None:
    target = tmp_path / "key.pem"
    write_private(target, b"one")
    assert target.read_bytes() == b"one"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    write_private(target, b"two")
    assert target.read_bytes() == b"two"
    assert sorted(_dir_entries(tmp_path)) == ["key.pem"]


def test_write_private_replaces_a_symlink_and_does_not_follow_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched")
    link = tmp_path / "key.pem"
    link.symlink_to(victim)
    write_private(link, b"secret")
    assert not link.is_symlink() and link.read_bytes() == b"secret"
    assert victim.read_bytes() == b"untouched"


def test_a_rejoining_node_proves_it_holds_the_same_key() -> None:
    """A CSR made again from the stored key names the same public key as the certificate issued
    for the first one; a new key names another."""
    ca = ClusterCA.create()
    key_pem = pki.new_key()
    first = ca.sign_node(pki.csr_for_key(key_pem, "n1"), node_id="n1", hosts=["127.0.0.1"])
    again = pki.csr_for_key(key_pem, "n1")
    assert pki.public_key_sha256(again) == pki.public_key_sha256(first)
    _, other = pki.make_key_and_csr("n1")
    assert pki.public_key_sha256(other) != pki.public_key_sha256(first)
    with pytest.raises(PKIError):
        pki.csr_for_key(b"not a key", "n1")
    with pytest.raises(PKIError):
        pki.public_key_sha256(b"garbage")


# ---- the API's own HTTPS certificate ----------------------------------------------------------------


def test_api_certificate_contents(ca: ClusterCA) -> None:
    cert_pem, key_pem = ca.issue_api_server(["space-api.space.svc", "10.0.0.7"], days=30)
    cert = x509.load_pem_x509_certificate(cert_pem)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "api:space-api.space.svc"
    eku = cert.extensions.get_extension_for_oid(ExtensionOID.EXTENDED_KEY_USAGE).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["space-api.space.svc"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    with pytest.raises(PKIError, match="not a node certificate"):
        node_id_of(cert_pem)
    assert serialization.load_pem_private_key(key_pem, None).public_key() == cert.public_key()


@pytest.mark.parametrize("hosts", [[], ["n1.node.space.internal"], ["ok.example", "x.node.space.internal"], ["a b"]])
def test_api_certificate_refuses_bad_or_node_names(ca: ClusterCA, hosts: list[str]) -> None:
    with pytest.raises(PKIError):
        ca.issue_api_server(hosts)


def test_api_certificate_cannot_pass_for_a_node(tmp_path: Path, ca: ClusterCA, tls_version: ssl.TLSVersion) -> None:
    """A stolen API key serving at a node's address: the control plane dials nodes by their identity
    name (``<id>.node.space.internal``), which no API certificate can carry."""
    impostor = node_server(tmp_path, ca, ca.issue_api_server(list(HOSTS)))
    out = round_trip(impostor, control_plane(ca, tls_version), pki.identity_name("n1"))
    assert_refused(out)
    assert isinstance(out.client_error, ssl.SSLCertVerificationError), client_reason(out)
