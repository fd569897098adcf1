"""The E2B facade's wire pieces without a server: Connect envelopes, routing, exit statuses, egress."""

from __future__ import annotations

import json
import signal

import pytest

from space.e2b import connect, tokens
from space.e2b.connect import ConnectError, EnvelopeReader, end_of_stream, envelope
from space.e2b.control import E2BError, Network, egress_of
from space.e2b.edge import ENVD_PORT, Route, route_of
from space.e2b.process import end_event
from tests.store.storekit import new_sandbox


def _scope(**headers: str) -> dict[str, object]:
    return {"type": "http", "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_envelopes_round_trip_in_any_chunking() -> None:
    data = envelope({"a": 1}) + envelope({"b": "x" * 300}) + end_of_stream(ConnectError("not_found", "gone"))
    for size in (1, 3, 7, len(data)):
        reader = EnvelopeReader()
        got = []
        for i in range(0, len(data), size):
            got += reader.feed(data[i:i + size])
        assert got == [(0, {"a": 1}), (0, {"b": "x" * 300}),
                       (connect.FLAG_END, {"error": {"code": "not_found", "message": "gone"}})]
        assert reader.pending == 0


def test_wire_bytes_match_the_sdk_observation() -> None:
    # E2B_COMPAT.md C.1: flag byte, 4-byte big-endian length, JSON.
    msg = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hello"]}, "stdin": False}
    raw = envelope(msg)
    assert raw[:1] == b"\x00"
    assert int.from_bytes(raw[1:5], "big") == len(raw) - 5
    assert json.loads(raw[5:]) == msg
    assert end_of_stream() == b"\x02\x00\x00\x00\x02{}"


def test_reader_refuses_compressed_oversized_and_non_objects() -> None:
    with pytest.raises(ConnectError) as info:
        EnvelopeReader().feed(b"\x01\x00\x00\x00\x02{}")
    assert info.value.code == "internal"
    with pytest.raises(ConnectError) as info:
        EnvelopeReader().feed(b"\x00" + (connect.MAX_MESSAGE + 1).to_bytes(4, "big"))
    assert info.value.code == "resource_exhausted"
    with pytest.raises(ConnectError) as info:
        EnvelopeReader().feed(b"\x00\x00\x00\x00\x02[]")
    assert info.value.code == "invalid_argument"


def test_unary_error_statuses() -> None:
    for code, status in (("not_found", 404), ("invalid_argument", 400), ("unauthenticated", 401),
                         ("deadline_exceeded", 504), ("unavailable", 503), ("already_exists", 409)):
        resp = ConnectError(code, "m").response()
        assert resp.status_code == status
        assert resp.media_type == "application/json"
        assert json.loads(bytes(resp.body)) == {"code": code, "message": "m"}


def test_proto_scalars() -> None:
    assert connect.uint("5", "x") == 5 and connect.uint(5, "x") == 5
    assert connect.unb64("aGVsbG8=", "x") == b"hello" and connect.unb64("aGVsbG8", "x") == b"hello"
    for bad in (True, "5a", None, 1.5):
        with pytest.raises(ConnectError):
            connect.uint(bad, "x")
    with pytest.raises(ConnectError):
        connect.unb64(5, "x")


def test_routing_by_header_and_host() -> None:
    assert route_of(_scope(e2b_sandbox_id="sabc"), None) == Route("sabc", ENVD_PORT)
    assert route_of(_scope(e2b_sandbox_id="sabc", e2b_sandbox_port="49999"), None) == Route("sabc", 49999)
    assert route_of(_scope(host="127.0.0.1:8080"), None) is None
    host = _scope(host="8000-sabc123.sandbox.example.com")
    assert route_of(host, None) is None  # host routing only with a configured domain
    assert route_of(host, "sandbox.example.com") == Route("sabc123", 8000)
    assert route_of(_scope(host="49983-sabc.other.com"), "sandbox.example.com") is None
    assert route_of(_scope(host="8000-sabc.sandbox.example.com:443"), "sandbox.example.com") == Route("sabc", 8000)
    # The header wins over the host.
    both = _scope(host="8000-sother.sandbox.example.com", e2b_sandbox_id="sabc")
    assert route_of(both, "sandbox.example.com") == Route("sabc", ENVD_PORT)


def test_envd_tokens_are_per_sandbox_row_and_per_secret() -> None:
    sb = new_sandbox(id="sabc", token_nonce=tokens.fresh_nonce())
    t = tokens.envd_token(b"k1", sb)
    assert tokens.check_envd(b"k1", sb, t)
    assert not tokens.check_envd(b"k1", new_sandbox(id="sabd", token_nonce=sb.token_nonce), t)
    assert not tokens.check_envd(b"k1", new_sandbox(id="sabc", token_nonce=tokens.fresh_nonce()), t)
    assert not tokens.check_envd(b"k2", sb, t)
    # A row without a nonce has no valid token at all.
    assert not tokens.check_envd(b"k1", new_sandbox(id="sabc"), t)


def test_exit_statuses_read_like_go() -> None:
    assert end_event(0, None) == {"exitCode": 0, "exited": True, "status": "exit status 0"}
    assert end_event(3, None) == {"exitCode": 3, "exited": True, "status": "exit status 3", "error": "exit status 3"}
    killed = end_event(137, int(signal.SIGKILL))
    assert killed == {"exitCode": -1, "exited": False, "status": "signal: killed", "error": "signal: killed"}
    assert end_event(143, int(signal.SIGTERM))["status"] == "signal: terminated"


def test_e2b_network_options_become_an_egress_policy() -> None:
    assert egress_of(None, None) is None
    assert egress_of(False, None) == {"default": "deny"}
    net = Network.model_validate({"allowOut": ["pypi.org"], "denyOut": ["0.0.0.0/0"]})
    doc = egress_of(None, net)
    assert doc is not None and doc["default"] == "deny" and doc["allow"] == ["pypi.org"]
    assert "deny" not in doc
    with pytest.raises(E2BError) as info:
        egress_of(None, Network.model_validate({"allowOut": ["not a rule!"]}))
    assert info.value.status == 400
