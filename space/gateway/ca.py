"""The per-deployment CA the gateway signs intercepted connections' certificates with.

Written once, in mitmproxy's confdir layout so mitmproxy picks it up as its own CA:
``mitmproxy-ca.pem`` (private key + certificate, mode 0600) and ``mitmproxy-ca-cert.pem`` (the
certificate alone: what sandboxes and templates trust).
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CA_NAME = "SPACE egress CA"
KEY_FILE = "mitmproxy-ca.pem"
CERT_FILE = "mitmproxy-ca-cert.pem"
VALIDITY = dt.timedelta(days=3650)


def ensure_ca(directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(cert_path, key_path)`` of the CA in ``directory``, creating it on first use.

    ``key_path`` holds key and certificate (mitmproxy's format). An existing CA is never replaced:
    every sandbox trusts it.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_path, cert_path = d / KEY_FILE, d / CERT_FILE
    if key_path.exists():
        if not cert_path.exists():  # the public half is derivable: rewrite it
            cert = x509.load_pem_x509_certificate(key_path.read_bytes())
            _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return cert_path, key_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "SPACE")])
    now = dt.datetime.now(dt.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))  # tolerate a little clock skew in sandboxes
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                serialization.NoEncryption())
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    # The public half first: a crash between the two writes leaves no key without its cert.
    _write(cert_path, cert_pem, 0o644)
    _write(key_path, key_pem + cert_pem, 0o600)
    return cert_path, key_path


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
