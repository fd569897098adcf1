"""The cluster's public-key infrastructure: the cluster CA, node certificates, control-plane client
certificates, and the TLS contexts of the node API's mutual TLS.

The control plane holds the cluster CA. A joining node makes its own key and a CSR
(:func:`make_key_and_csr`); the CA signs it (:meth:`ClusterCA.sign_node`) into a node certificate,
and that certificate is the node's identity (:func:`node_id_of`). The node API is served over mutual
TLS (:func:`server_context`); control-plane processes (API replicas, controllers) mint a short-lived
client certificate from the CA at startup (:meth:`ClusterCA.issue_client`) and call nodes with it
(:func:`client_context`).

Roles are separated at the TLS layer by the extended key usage, which the CA alone decides: a node
certificate carries serverAuth only, a control-plane certificate clientAuth only, whatever a CSR
asks for. OpenSSL verifies the peer's chain for a purpose that its handshake sets itself:
``ssl_client`` when a server verifies its client, ``ssl_server`` when a client verifies its server
(``ssl_verify_cert_chain``), unless the application set another, which Python's ``ssl`` never does
(it has no binding to ``X509_VERIFY_PARAM_set_purpose``). The purpose check refuses a leaf whose EKU
lacks clientAuth (resp. serverAuth) with ``X509_V_ERR_INVALID_PURPOSE`` ("unsuitable certificate
purpose") and the handshake fails. So by OpenSSL's defaults, with no setting of ours:

* a node certificate presented as a client certificate is refused by every node's server, so a
  compromised node cannot drive its peers;
* a control-plane certificate presented as a server certificate is refused by the control plane's
  client, so a stolen control-plane key cannot impersonate a node.

``tests/cluster/test_pki.py`` pins both refusals over real loopback TLS (1.2 and 1.3) and checks
that the reason given is the purpose: if an OpenSSL ever stopped doing this, those tests fail.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import secrets
import ssl
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: A CSR is a key and a name: anything bigger is not one of ours, and is not parsed.
MAX_CSR_BYTES = 16 * 1024

#: Backdating of ``not_valid_before``: a freshly issued certificate must verify on a peer whose clock
#: is a little behind the CA's.
CLOCK_SKEW = datetime.timedelta(minutes=5)

NODE_PREFIX = "node:"
CLIENT_PREFIX = "control-plane:"
#: The CN prefix of the API's own serving certificate (what nodes dial to join and report).
API_PREFIX = "api:"
ORGANIZATION = "space"

MIN_RSA_BITS = 2048
#: Verifying a CSR's signature costs more the bigger the modulus: a bound keeps a hostile CSR cheap.
MAX_RSA_BITS = 8192
#: SAN entries of one node certificate.
MAX_HOSTS = 64

# A node id or control-plane name, as it goes into a CN (at most 64 characters with its prefix).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,49}", re.ASCII)
# RFC 1123 host names, lowercase, no wildcard, no trailing dot.
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOSTNAME_RE = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}", re.ASCII)
_MAX_HOSTNAME = 253

_IssuerKey: TypeAlias = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey
_PublicKey: TypeAlias = ec.EllipticCurvePublicKey | rsa.RSAPublicKey


class PKIError(ValueError):
    """A refusal: a certificate, key, CSR, name or host this module will not use or issue."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _check_days(days: int) -> None:
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise PKIError(f"validity must be a positive number of days, not {days!r}")


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise PKIError(f"{what} {name!r} is not 1-50 letters, digits, '.', '_' or '-' starting with a letter or digit")
    return name


def _check_public_key(key: object, what: str) -> _PublicKey:
    """``key`` if it is one whose strength we know: EC P-256, or RSA of 2048 to 8192 bits."""
    if isinstance(key, ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, ec.SECP256R1):
            raise PKIError(f"{what}: EC key on curve {key.curve.name}, only P-256 (secp256r1) is accepted")
        return key
    if isinstance(key, rsa.RSAPublicKey):
        if not MIN_RSA_BITS <= key.key_size <= MAX_RSA_BITS:
            raise PKIError(f"{what}: RSA key of {key.key_size} bits, {MIN_RSA_BITS} to {MAX_RSA_BITS} are accepted")
        return key
    raise PKIError(f"{what}: {type(key).__name__} keys are not accepted (EC P-256 or RSA >= {MIN_RSA_BITS} only)")


def _san(host: str) -> x509.GeneralName:
    """One SAN entry: an IP address as itself, anything else must be a strict DNS host name."""
    if not isinstance(host, str):
        raise PKIError(f"host {host!r} is not a string")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        # A scoped IPv6 address (fe80::1%eth0) names an interface of one machine, not a peer.
        if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id is not None:
            raise PKIError(f"host {host!r}: scoped IPv6 addresses are not accepted")
        return x509.IPAddress(ip)
    # ASCII before lowercasing: str.lower maps some non-ASCII letters (U+212A, Kelvin) to ASCII ones.
    name = host.lower() if host.isascii() else ""
    if (len(name) > _MAX_HOSTNAME or not _HOSTNAME_RE.fullmatch(name)
            # An all-digit last label would read as (part of) an IPv4 address to some resolvers.
            or name.rsplit(".", 1)[-1].isdigit()):
        raise PKIError(f"host {host!r} is neither an IP address nor a valid DNS host name")
    return x509.DNSName(name)


def _host_sans(hosts: Sequence[str], what: str) -> list[x509.GeneralName]:
    """The SAN entries of ``hosts`` (a sequence, not one string), deduplicated: at least one, at
    most :data:`MAX_HOSTS`."""
    if isinstance(hosts, str):
        raise PKIError("hosts must be a sequence of host names, not one string")
    sans = list(dict.fromkeys(_san(h) for h in hosts))
    if not sans:
        raise PKIError(f"{what} needs at least one host")
    if len(sans) > MAX_HOSTS:
        raise PKIError(f"{len(sans)} hosts, at most {MAX_HOSTS}")
    return sans


def _subject(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION)])


def _private_pem(key: _IssuerKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_cert(cert_pem: bytes, what: str) -> x509.Certificate:
    if not isinstance(cert_pem, bytes):
        raise PKIError(f"{what}: expected PEM bytes, got {type(cert_pem).__name__}")
    try:
        return x509.load_pem_x509_certificate(cert_pem)
    except ValueError as e:
        raise PKIError(f"{what}: not a PEM certificate ({e})") from None


def _common_name(cert: x509.Certificate) -> str | None:
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(cns) != 1 or not isinstance(cns[0].value, str):
        return None
    return cns[0].value


@dataclass(frozen=True)
class ClusterCA:
    """The cluster CA: its certificate and its key (unencrypted PKCS8 PEM).

    Every instance is checked when made (an unexpired CA certificate, an EC P-256 or RSA key that
    matches it), so whatever holds one can sign with it. The key stays out of ``repr``: a CA in a
    log line must not leak it.
    """

    cert_pem: bytes
    key_pem: bytes = field(repr=False)
    _cert: x509.Certificate = field(init=False, repr=False, compare=False)
    _key: _IssuerKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        cert = _load_cert(self.cert_pem, "CA certificate")
        try:
            bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            raise PKIError("CA certificate: no BasicConstraints, it is not a CA") from None
        if not bc.ca:
            raise PKIError("CA certificate: BasicConstraints ca=False, it is not a CA")
        with contextlib.suppress(x509.ExtensionNotFound):
            if not cert.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign:
                raise PKIError("CA certificate: its KeyUsage does not allow signing certificates")
        if cert.not_valid_after_utc <= _now():
            raise PKIError(f"CA certificate expired at {cert.not_valid_after_utc.isoformat()}")
        if not isinstance(self.key_pem, bytes):
            raise PKIError(f"CA key: expected PEM bytes, got {type(self.key_pem).__name__}")
        try:
            key = serialization.load_pem_private_key(self.key_pem, password=None)
        except TypeError:
            raise PKIError("CA key: encrypted, an unencrypted PKCS8 key is expected") from None
        except (ValueError, UnsupportedAlgorithm) as e:
            raise PKIError(f"CA key: not a PEM private key ({e})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
            raise PKIError(f"CA key: {type(key).__name__} keys are not accepted (EC P-256 or RSA only)")
        _check_public_key(key.public_key(), "CA key")
        spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
            raise PKIError("CA key does not match the CA certificate's public key")
        object.__setattr__(self, "_cert", cert)
        object.__setattr__(self, "_key", key)

    @classmethod
    def create(cls, name: str = "space cluster CA", *, days: int = 3650) -> ClusterCA:
        """A new self-signed CA (EC P-256) that can sign leaf certificates only (path length 0)."""
        if not isinstance(name, str) or not 0 < len(name) <= 64 or not name.isprintable():
            raise PKIError(f"CA name {name!r} must be 1-64 printable characters")
        _check_days(days)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = _subject(name)
        now = _now()
        cert = (x509.CertificateBuilder()
                .subject_name(subject).issuer_name(subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False, key_agreement=False,
                                             key_cert_sign=True, crl_sign=True, encipher_only=False,
                                             decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(cert.public_bytes(serialization.Encoding.PEM), _private_pem(key))

    @classmethod
    def load(cls, cert_pem: bytes, key_pem: bytes) -> ClusterCA:
        """The CA from its stored PEMs; PKIError unless the certificate is a CA's and the key is its key.

        The key is re-encoded as unencrypted PKCS8 (``key_pem``'s one format) whatever PEM it came in.
        """
        ca = cls(cert_pem, key_pem)
        return cls(ca._cert.public_bytes(serialization.Encoding.PEM), _private_pem(ca._key))

    @property
    def fingerprint(self) -> str:
        """SHA-256 of the CA certificate's DER, in hex: what a joining node pins before trusting the CA."""
        return self._cert.fingerprint(hashes.SHA256()).hex()

    def _leaf(self, subject: x509.Name, public_key: _PublicKey,
              sans: list[x509.GeneralName], eku: x509.ObjectIdentifier, days: int) -> bytes:
        """A leaf certificate. Its lifetime ends with the CA's at the latest: a peer would refuse it after."""
        now = _now()
        not_after = min(now + datetime.timedelta(days=days), self._cert.not_valid_after_utc)
        is_ec = isinstance(public_key, ec.EllipticCurvePublicKey)
        # TLS 1.3 and (EC)DHE suites only sign with the key (digital_signature); key_agreement (EC) or
        # key_encipherment (RSA) also admit TLS 1.2's static-key exchanges, which some peers still pick.
        usage = x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=not is_ec,
                              data_encipherment=False, key_agreement=is_ec, key_cert_sign=False, crl_sign=False,
                              encipher_only=False, decipher_only=False)
        try:
            ski = self._cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
            aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)
        except x509.ExtensionNotFound:
            aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key())
        builder = (x509.CertificateBuilder()
                   .subject_name(subject).issuer_name(self._cert.subject)
                   .public_key(public_key)
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - CLOCK_SKEW).not_valid_after(not_after)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(usage, critical=True)
                   .add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
                   .add_extension(aki, critical=False)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(self._key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)

    def sign_node(self, csr_pem: bytes, *, node_id: str, hosts: Sequence[str], days: int = 365) -> bytes:
        """The node certificate (PEM) for the key in ``csr_pem``: CN ``node:<node_id>``, SAN ``hosts``,
        serverAuth only.

        The CSR proves possession of the key and supplies nothing else: its subject, SAN, EKU and any
        other extension it asks for are ignored, so a joining node cannot ask for a control-plane name,
        client authentication or a CA. ``hosts`` (IP addresses or DNS names) are the names the control
        plane will dial the node by; at least one.
        """
        _check_name(node_id, "node id")
        _check_days(days)
        hosts_sans = _host_sans(hosts, "a node certificate")
        sans = list(dict.fromkeys([x509.DNSName(identity_name(node_id)), *hosts_sans]))
        if not isinstance(csr_pem, bytes):
            raise PKIError(f"CSR: expected PEM bytes, got {type(csr_pem).__name__}")
        if len(csr_pem) > MAX_CSR_BYTES:
            raise PKIError(f"CSR of {len(csr_pem)} bytes, at most {MAX_CSR_BYTES}")
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
            csr_key = csr.public_key()
        except (ValueError, UnsupportedAlgorithm) as e:
            raise PKIError(f"CSR: not a PEM certificate signing request ({e})") from None
        # The key is checked before the signature: verifying with a key we refuse anyway is wasted work.
        public_key = _check_public_key(csr_key, "CSR")
        try:
            valid = csr.is_signature_valid
        except (ValueError, UnsupportedAlgorithm):
            valid = False
        if not valid:
            raise PKIError("CSR: its signature does not verify, it was not made with the key it carries")
        return self._leaf(_subject(NODE_PREFIX + node_id), public_key, sans, ExtendedKeyUsageOID.SERVER_AUTH, days)

    def issue_client(self, name: str, *, days: int = 30) -> tuple[bytes, bytes]:
        """A fresh key and a control-plane client certificate for it: ``(cert_pem, key_pem)``.

        CN ``control-plane:<name>``, clientAuth only and no SAN: it authenticates to nodes and can
        serve nothing. Short-lived by default, since each process mints its own at startup.
        """
        _check_name(name, "control-plane name")
        _check_days(days)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._leaf(_subject(CLIENT_PREFIX + name), key.public_key(), [], ExtendedKeyUsageOID.CLIENT_AUTH, days)
        return cert, _private_pem(key)

    def issue_api_server(self, hosts: Sequence[str], *, days: int = 365) -> tuple[bytes, bytes]:
        """A fresh key and a serving certificate for the API replicas: ``(cert_pem, key_pem)``.

        CN ``api:<first host>``, serverAuth only, SAN ``hosts`` (the names nodes reach the API by,
        e.g. its in-cluster Service). It carries no node identity name (``*.node.space.internal``),
        so it can never pass for a node, and no clientAuth, so nodes do not take it for the
        control plane's client certificate.
        """
        _check_days(days)
        sans = _host_sans(hosts, "an API certificate")
        if any(isinstance(n, x509.DNSName) and n.value.endswith(IDENTITY_SUFFIX) for n in sans):
            raise PKIError(f"an API certificate cannot name a node identity (*{IDENTITY_SUFFIX})")
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self._leaf(_subject(API_PREFIX + _check_name(hosts[0], "API host")), key.public_key(), sans,
                          ExtendedKeyUsageOID.SERVER_AUTH, days)
        return cert, _private_pem(key)


#: The DNS suffix of node identity names (never resolved: only checked against certificates).
IDENTITY_SUFFIX = ".node.space.internal"


def identity_name(node_id: str) -> str:
    """The name every node certificate carries for its node id, and the name the control plane
    checks a node's certificate against (TLS SNI and host name check) whatever address it dials:
    a node that advertised another node's address is refused in the handshake, before a request
    meant for one node reaches the other. A hash, so any node id makes a valid DNS label."""
    _check_name(node_id, "node id")
    digest = hashes.Hash(hashes.SHA256())
    digest.update(node_id.encode())
    return "n-" + digest.finalize().hex()[:40] + IDENTITY_SUFFIX


def make_key_and_csr(node_id: str) -> tuple[bytes, bytes]:
    """A fresh EC P-256 key (unencrypted PKCS8 PEM) and a CSR (PEM) signed by it, CN ``node_id``.

    What a joining node sends is the CSR; the key never leaves the node.
    """
    key_pem = new_key()
    return key_pem, csr_for_key(key_pem, node_id)


def new_key() -> bytes:
    """A fresh EC P-256 private key, unencrypted PKCS8 PEM."""
    return _private_pem(ec.generate_private_key(ec.SECP256R1()))


def csr_for_key(key_pem: bytes, node_id: str) -> bytes:
    """A CSR (PEM) signed by the key ``key_pem``: a node that joins again (a restart, a new address)
    proves with it that it holds the key it first joined with."""
    _check_name(node_id, "node id")
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise PKIError(f"node key: not an unencrypted PEM private key ({e})") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise PKIError(f"node key: {type(key).__name__} keys are not supported")
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


def public_key_sha256(pem: bytes) -> str:
    """sha256 hex of the public key (SubjectPublicKeyInfo DER) a CSR or certificate carries: what
    ties a node to its key across joins."""
    try:
        if b"CERTIFICATE REQUEST" in pem[:64]:
            key = x509.load_pem_x509_csr(pem).public_key()
        else:
            key = x509.load_pem_x509_certificate(pem).public_key()
    except (ValueError, UnsupportedAlgorithm) as e:
        raise PKIError(f"not a PEM CSR or certificate ({e})") from None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    digest = hashes.Hash(hashes.SHA256())
    digest.update(der)
    return digest.finalize().hex()


def node_id_of(cert_pem: bytes) -> str:
    """The node id a node certificate names (its CN is ``node:<id>``, its EKU serverAuth); PKIError otherwise.

    It reads the certificate only: that it was issued by the cluster CA is the TLS handshake's to check.
    """
    cert = _load_cert(cert_pem, "node certificate")
    cn = _common_name(cert)
    if cn is None or not cn.startswith(NODE_PREFIX):
        raise PKIError(f"not a node certificate: its subject is {cert.subject.rfc4514_string()!r}")
    try:
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        raise PKIError("not a node certificate: it has no extended key usage") from None
    if list(eku) != [ExtendedKeyUsageOID.SERVER_AUTH]:
        raise PKIError("not a node certificate: its extended key usage is not serverAuth only")
    return _check_name(cn.removeprefix(NODE_PREFIX), "node id")


def server_context(cert_file: Path, key_file: Path, ca_file: Path) -> ssl.SSLContext:
    """The node API server's TLS context: serves the node certificate, and requires a client certificate
    from the cluster CA.

    OpenSSL verifies the client's certificate for the ``ssl_client`` purpose (module docstring), so
    only clientAuth certificates, the control plane's, are accepted; another node's is refused.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cafile=ca_file)
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        raise PKIError(f"node TLS files {cert_file}, {key_file}, {ca_file}: {e}") from None
    return ctx


def client_context(cert_pem: bytes, key_pem: bytes, ca_pem: bytes) -> ssl.SSLContext:
    """The control plane's TLS context for calling nodes: trusts the cluster CA only, checks the node's
    host name against its certificate, and presents the control-plane client certificate.

    OpenSSL verifies the node's certificate for the ``ssl_server`` purpose, so a clientAuth-only
    certificate (a control-plane one) is refused as a server's.
    """
    _load_cert(ca_pem, "CA certificate")
    _load_cert(cert_pem, "client certificate")
    if not isinstance(key_pem, bytes):
        raise PKIError(f"client key: expected PEM bytes, got {type(key_pem).__name__}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # cadata as str: bytes would be read as DER.
        ctx.load_verify_locations(cadata=ca_pem.decode("ascii"))
        # load_cert_chain reads files only: _pem_file gives it one that never reaches a disk (or a 0600
        # one in a private temporary directory, removed as soon as it is read).
        with _pem_file(cert_pem.rstrip(b"\n") + b"\n" + key_pem) as path:
            ctx.load_cert_chain(path)
    except (ssl.SSLError, UnicodeDecodeError) as e:
        raise PKIError(f"client TLS material does not load: {e}") from None
    return ctx


@contextlib.contextmanager
def _pem_file(data: bytes) -> Iterator[str]:
    """A path to read ``data`` from, for ``load_cert_chain`` (which reads files only), gone on exit.

    On Linux an anonymous memory file (``memfd_create``), opened again through ``/proc/self/fd``:
    the private key never reaches a file system, and nothing is left behind even if the process
    dies here. Elsewhere a private (0700) temporary directory holding a 0600 file, removed on exit.
    """
    if sys.platform == "linux" and os.path.isdir("/proc/self/fd"):
        try:
            fd = os.memfd_create("space-tls", os.MFD_CLOEXEC)
        except OSError:
            pass
        else:
            try:
                _write_all(fd, data)
                yield f"/proc/self/fd/{fd}"
            finally:
                os.close(fd)
            return
    with _temp_pem_file(data) as path:
        yield path


@contextlib.contextmanager
def _temp_pem_file(data: bytes) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="space-tls-") as d:
        path = os.path.join(d, "chain.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        yield path


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` (a key, a certificate) to ``path`` atomically, readable by its owner only.

    A temporary file in the same directory (created exclusively, never through a symlink, mode 0600
    from the start so the content is never readable by others), synced, then renamed over ``path``:
    a reader sees the old file or the whole new one, and a symlink planted at ``path`` is replaced,
    not followed.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # The rename is durable once the directory is.
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
