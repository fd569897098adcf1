"""The gateway's pure parts, in-process: policy, registry, journal, redaction, CA."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec

from space.egress_policy import Egress, Fence, Policy, parse_ceiling
from space.errors import InvalidRequest
from space.gateway.ca import ensure_ca
from space.gateway.journal import Journal
from space.gateway.redact import StreamRedactor, needles_of
from space.gateway.registry import Registry, Secret, TokenBucket

ip = ipaddress.ip_address

# ---- policy (the language itself: tests/test_egress_policy.py) ------------------------------------


def egress(doc: dict[str, object], ceiling: tuple[str, ...] = ()) -> Egress:
    return Egress.build([doc], parse_ceiling(ceiling), Fence())


def test_port_limited_deny_does_not_deny_the_name() -> None:
    p = egress({"deny": ["smtp.example.com:25", "bad.example.com"]})
    assert p.check_name("smtp.example.com", 0) is None  # DNS: still resolvable
    denied = p.check_name("smtp.example.com", 25)
    assert denied is not None and not denied.allowed
    assert p.decide("smtp.example.com", 443, [ip("93.184.216.34")]).allowed
    assert not p.decide("smtp.example.com", 25, [ip("93.184.216.34")]).allowed
    bad = p.check_name("bad.example.com", 0)
    assert bad is not None and not bad.allowed


def test_blocked_ranges_need_a_cidr_not_a_name() -> None:
    p = egress({"allow": ["api.example.com"]})
    d = p.decide("api.example.com", 443, [ip("169.254.169.254")])
    assert not d.allowed and d.rule == "blocked-range"
    # A private range: the operator's ceiling and a CIDR (reached by address, or by a name a host
    # rule allows); the rule's port only.
    p2 = egress({"allow": ["api.example.com", "db.internal", "10.0.0.0/8:5432"]}, ceiling=("10.0.0.0/8",))
    assert p2.decide("db.internal", 5432, [ip("10.1.2.3")]).allowed
    assert p2.decide("10.1.2.3", 5432).allowed
    assert not p2.decide("db.internal", 22, [ip("10.1.2.3")]).allowed
    assert not egress({"allow": ["db.internal", "10.0.0.0/8:5432"]}).decide("10.1.2.3", 5432).allowed  # no ceiling
    assert not p2.decide("x", 443, [ip("::ffff:169.254.169.254")]).allowed  # v4-mapped v6 too


def test_allowlist_and_default() -> None:
    p = egress({"allow": ["*.github.com"]})
    assert p.decide("api.github.com", 443, [ip("140.82.112.6")]).allowed
    assert not p.decide("github.com", 443, [ip("140.82.112.6")]).allowed  # *.x is not x itself
    assert egress({}).decide("anything.org", 443, [ip("93.184.216.34")]).allowed
    with pytest.raises(InvalidRequest):
        Policy.from_doc({"allow": ["not a host"]})


# ---- registry --------------------------------------------------------------------------------------


def test_registry_validates_and_keeps_rate_buckets_across_identical_puts() -> None:
    reg = Registry()
    doc = {"ip": "10.201.0.6", "sandbox": "sb-1", "tenant": "t", "policy": {"allow": ["api.test"]},
           "secrets": [{"name": "n", "secret_id": "s", "hosts": ["api.test"], "header": "Authorization",
                        "value": "Bearer abcdefghij", "rate_limit": 1}]}
    entry = reg.put(doc)
    assert reg.get("::ffff:10.201.0.6") is entry
    s = entry.secrets[0]
    assert reg.take(entry.ip, s) and not reg.take(entry.ip, s)
    reg.put(doc)  # same secret, same limit: the bucket stays empty
    assert not reg.take(entry.ip, reg.get(entry.ip).secrets[0])  # type: ignore[union-attr]
    for bad in ({**doc, "ip": "nope"}, {**doc, "policy": {"allow": ["bad host"]}},
                {**doc, "secrets": [{"name": "n"}]},
                {**doc, "secrets": [{**doc["secrets"][0], "header": "Bad Header"}]},  # type: ignore[index]
                {**doc, "secrets": [{**doc["secrets"][0], "expires_at": "tomorrow"}]}):  # type: ignore[index]
        with pytest.raises(InvalidRequest):
            reg.put(bad)
    assert reg.get(entry.ip) is not None  # a bad put leaves the entry alone


def test_token_bucket_refills_per_minute() -> None:
    b = TokenBucket(rate=60, tokens=0.0, stamp=100.0)
    assert not b.take(100.5)
    assert b.take(101.1)  # one per second


def test_secret_expiry_and_needles() -> None:
    s = Secret.from_doc({"name": "n", "secret_id": "s", "hosts": ["*.example.com"], "header": "Authorization",
                         "value": "token ghp_abcdefgh123", "expires_at": "2020-01-01T00:00:00Z"})
    assert s.expired() and s.matches("api.example.com") and not s.matches("example.com")
    assert s.needles() == [b"token ghp_abcdefgh123", b"ghp_abcdefgh123"]
    short = Secret.from_doc({"name": "n", "secret_id": "s", "hosts": ["x.com"], "header": "X-Key", "value": "ab cd"})
    assert short.needles() == [b"ab cd"]  # a short bare value would mangle unrelated text
    assert "value" not in short.public()


# ---- redaction -------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_stream_redactor_masks_across_chunk_boundaries(chunk: int) -> None:
    secret = Secret.from_doc({"name": "n", "secret_id": "s", "hosts": ["x.com"], "header": "Authorization",
                              "value": "Bearer SECRETSECRET"})
    body = b"head Bearer SECRETSECRET mid SECRETSECRET tail" * 3
    red = StreamRedactor(needles_of([secret]))
    out = b"".join(b"".join(red(body[i:i + chunk])) for i in range(0, len(body), chunk)) + b"".join(red(b""))
    assert len(out) == len(body)
    assert b"SECRET" not in out
    assert out.startswith(b"head " + b"*" * len("Bearer SECRETSECRET") + b" mid " + b"*" * 12 + b" tail")


# ---- journal ---------------------------------------------------------------------------------------


def test_journal_reads_acks_and_numbers_on_after_reopen(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    for i in range(5):
        j.append("t", "sb", "egress.allow", f"h{i}:443", "allowed", {"i": i})
    recs, last = j.read(0, 2)
    assert [r["seq"] for r in recs] == [1, 2] and last == 2
    recs, last = j.read(last, 100)
    assert [r["seq"] for r in recs] == [3, 4, 5] and recs[0]["details"] == {"i": 2}
    assert j.ack(3) == 3 and j.ack(2) == 3 and j.ack(99) == 5
    assert j.read(0)[0] == []
    # A torn last line from a crash is skipped; numbering goes on past everything seen.
    j2 = Journal(tmp_path)
    assert j2.last == 5
    j2.append("t", "sb", "egress.deny", "x:1", "denied")
    seg = sorted(tmp_path.glob("seg-*.jsonl"))[-1]
    with open(seg, "a") as f:
        f.write('{"seq": 7, "trunc')
    j3 = Journal(tmp_path)
    assert j3.last == 6 and [r["seq"] for r in j3.read(0)[0]] == [6]
    assert json.loads(seg.read_text().splitlines()[0])["action"] == "egress.deny"


# ---- CA --------------------------------------------------------------------------------------------


def test_ensure_ca_creates_once_in_mitmproxy_layout(tmp_path: Path) -> None:
    cert_path, key_path = ensure_ca(tmp_path / "conf")
    assert cert_path.name == "mitmproxy-ca-cert.pem" and key_path.name == "mitmproxy-ca.pem"
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    pem = key_path.read_bytes()
    assert b"PRIVATE KEY" in pem and b"BEGIN CERTIFICATE" in pem and b"PRIVATE" not in cert_path.read_bytes()
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "SPACE egress CA"
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.not_valid_after_utc - cert.not_valid_before_utc > dt.timedelta(days=3649)
    assert ensure_ca(tmp_path / "conf") == (cert_path, key_path)
    assert key_path.read_bytes() == pem  # never replaced


def test_a_journal_keeps_its_identity_and_a_reinstalled_one_gets_another(tmp_path: Path) -> None:
    j = Journal(tmp_path / "j")
    j.append("t", "s1", "egress", "example.com", "ok")
    j.flush()
    again = Journal(tmp_path / "j")
    assert again.id == j.id and len(j.id) == 16
    recs, _ = again.read(0, 10)
    assert [r["journal"] for r in recs] == [j.id]
    assert Journal(tmp_path / "reinstalled").id != j.id
