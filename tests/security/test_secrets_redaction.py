"""Finding 8: an upstream that echoes the injected credential back, in any of the encodings servers
use, hands it to the sandbox unless the gateway recognises it. A real gateway, a real TLS upstream
that echoes the Authorization header (decoded from Basic, too) in each encoding, in the body and a
header, with a Content-Length, chunked, and gzip-compressed."""

from __future__ import annotations

import base64
import binascii
import gzip
import json
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from space.credentials.manager import header_value
from tests.gateway.harness import GATEWAY_PY, SB1, Gateway, UpstreamPKI, make_pki, running_gateway

USER, PASSWORD = "alice", "s3cr/et pa+ss-é-0123456789"
PAIR = f"{USER}:{PASSWORD}"
VALUE = header_value("basic", PAIR)  # "Basic <base64 of the pair>"
TOKEN = VALUE.split(" ", 1)[1]


def _json_slashes(text: str) -> str:
    return json.dumps(text).replace("/", "\\/")  # PHP's json_encode, and others, escape "/"


#: How the upstream spells what it echoes, and how to undo that (what a sandbox would do).
ENCODINGS: dict[str, tuple[Callable[[str], str], Callable[[str], str]]] = {
    "verbatim": (lambda v: v, lambda v: v),
    "json": (json.dumps, json.loads),
    "json_slashes_unicode": (_json_slashes, json.loads),
    "percent_upper": (lambda v: urllib.parse.quote(v, safe=""), urllib.parse.unquote),
    "percent_lower": (lambda v: "".join(f"%{b:02x}" for b in v.encode()), urllib.parse.unquote),
    "form": (urllib.parse.quote_plus, urllib.parse.unquote_plus),
    "base64": (lambda v: base64.b64encode(v.encode()).decode(), lambda v: base64.b64decode(v).decode(errors="replace")),
    "base64url_in_text": (lambda v: base64.urlsafe_b64encode(b"seen: " + v.encode()).decode(),
                          lambda v: base64.urlsafe_b64decode(v).decode(errors="replace")),
}
#: What of the request the upstream echoes.
PARTS: dict[str, Callable[[str], str]] = {
    "header": lambda auth: auth,
    "basic_pair": lambda auth: base64.b64decode(auth.split(" ", 1)[1]).decode(),
    "basic_password": lambda auth: base64.b64decode(auth.split(" ", 1)[1]).decode().split(":", 1)[1],
}


class EncodingEcho(BaseHTTPRequestHandler):
    """``/<part>/<encoding>?transfer=length|chunked|gzip``: that part of the request's Authorization
    header, spelled so, in the body and in ``X-Echo``."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        part, encoding = url.path.strip("/").split("/")
        transfer = urllib.parse.parse_qs(url.query).get("transfer", ["length"])[0]
        auth = self.headers.get("authorization", "")
        echoed = ENCODINGS[encoding][0](PARTS[part](auth)) if auth.startswith("Basic ") else "no credential"
        body = f"you sent: {echoed}\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream" if transfer == "binary" else "text/plain")
        self.send_header("X-Echo", echoed)
        if transfer == "gzip":
            body = gzip.compress(body)
            self.send_header("Content-Encoding", "gzip")
        if transfer == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(0, len(body), 7):  # small chunks: the echo straddles many of them
                piece = body[i:i + 7]
                self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> UpstreamPKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def echo_port(pki: UpstreamPKI) -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), EncodingEcho)
    server.daemon_threads = True
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki.leaf_cert, pki.leaf_key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory, pki: UpstreamPKI) -> Iterator[Gateway]:
    if not GATEWAY_PY.exists():
        pytest.skip("the gateway venv is missing: run `make gateway`")
    root: Path = tmp_path_factory.mktemp("gw")
    with running_gateway(root, pki) as g:
        g.put(SB1, {"allow": ["127.0.0.0/8", "api.test"]},
              [{"name": "basic", "secret_id": "sec-basic", "hosts": ["api.test"], "header": "Authorization",
                "value": VALUE, "expires_at": None, "rate_limit": None}])
        yield g


def _undo(encoding: str, text: str) -> str:
    try:
        return ENCODINGS[encoding][1](text)
    except (ValueError, binascii.Error, UnicodeError):
        return ""  # masked beyond decoding


@pytest.mark.parametrize("transfer", ["length", "chunked", "gzip"])
@pytest.mark.parametrize("encoding", list(ENCODINGS))
@pytest.mark.parametrize("part", list(PARTS))
def test_an_echoed_credential_never_reaches_the_sandbox(gw: Gateway, echo_port: int, part: str, encoding: str,
                                                        transfer: str) -> None:
    status, body, headers, issuer = gw.https(SB1, "api.test", echo_port, f"/{part}/{encoding}?transfer={transfer}")
    assert status == 200 and issuer == "SPACE egress CA"  # intercepted: the credential was injected
    if transfer == "gzip":
        assert headers.get("content-encoding") == "gzip"
        body = gzip.decompress(body)
    text = body.decode("utf-8", "replace")
    assert text.startswith("you sent: ") and "no credential" not in text
    echoed_body = text.removeprefix("you sent: ").rstrip("\n")
    for where, echoed in (("body", echoed_body), ("x-echo", headers.get("x-echo", ""))):
        for shown in (echoed, _undo(encoding, echoed)):
            for secret in (VALUE, TOKEN, PAIR, PASSWORD):
                assert secret not in shown, f"{where} ({part}, {encoding}, {transfer}) shows {secret!r}: {echoed!r}"


@pytest.mark.parametrize("encoding", ["verbatim", "base64", "base64url_in_text"])
@pytest.mark.parametrize("part", list(PARTS))
def test_a_binary_body_is_searched_for_the_literal_forms(gw: Gateway, echo_port: int, part: str,
                                                         encoding: str) -> None:
    """A body of a binary media type is not searched for JSON or percent escapes (no serializer
    writes them there), but still for the secret verbatim and in base64."""
    status, body, headers, _ = gw.https(SB1, "api.test", echo_port, f"/{part}/{encoding}?transfer=binary")
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    echoed = body.decode("utf-8", "replace").removeprefix("you sent: ").rstrip("\n")
    for shown in (echoed, _undo(encoding, echoed), headers.get("x-echo", "")):
        for secret in (VALUE, TOKEN, PAIR, PASSWORD):
            assert secret not in shown, f"{part}, {encoding}: {echoed!r}"
