"""Finding 9 (the API's part) and finding 10 of issue 13: what a client sends is bounded before
anything is done with it.

Aspects: a body larger than its route's class allows is refused (413, the error schema) from its
declared length, before authentication or any parsing, and a body with
no declared length as soon as it passes the bound; authentication happens before any body is read
(an unauthenticated request with a body is answered 401 at once); a slow client (no request, headers
dripped, a body that stops short of its length) is answered 408 or cut off within a bounded time;
stdin is bounded as it is read; a non-ASCII attach token, integers beyond what the store holds and
non-boolean booleans are 4xx at the edge, never a 500 or a silent coercion.

Every wait has a deadline; none asserts a duration: an answer that never comes fails at the deadline.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Server, create_sandbox, wait_for
from tests.security.api_fixtures import (
    RawAnswer,
    chunked,
    head,
    raw_connection,
    read_answer,
    send_until_answered,
)

pytestmark = pytest.mark.runtime

#: How long a test waits for an answer that the fixed server sends at once (or, for slow clients,
#: after its timeouts): generous on a loaded machine, and what an unfixed server never meets.
ANSWER_DEADLINE = 60.0
#: For slow clients: the server's body and header timeouts (30 s, 15 s) plus headroom.
SLOW_DEADLINE = 120.0
TWO_GB = 2 * 1024 ** 3
INT64_MAX = 2 ** 63 - 1


def _deadline(seconds: float = ANSWER_DEADLINE) -> float:
    return time.monotonic() + seconds


def _too_large(answer: RawAnswer | None) -> None:
    assert answer is not None, "no answer: the server went on reading the body"
    assert answer.status == 413, (answer.status, answer.body[:300])
    assert answer.error()["code"] == "too_large"


@pytest.fixture(scope="module")
def sandbox(server: Server) -> Iterator[str]:
    with server.client() as api:
        sid = create_sandbox(api)
        yield sid
        api.delete(f"/v1/sandboxes/{sid}")


# ---- bodies: declared, streamed, before authentication -------------------------------------------


@pytest.mark.parametrize("auth", ["admin", "none", "bogus"])
def test_a_2gb_json_body_is_refused_from_its_length_before_authentication(server: Server, auth: str) -> None:
    headers = {"Content-Type": "application/json", "Content-Length": str(TWO_GB)}
    if auth != "none":
        headers["Authorization"] = f"Bearer {server.admin_key if auth == 'admin' else 'bogus'}"
    with raw_connection(server) as s:
        s.sendall(head("POST", "/v1/sandboxes", headers) + b'{"template": "')
        _too_large(read_answer(s, _deadline()))


def test_a_json_body_without_a_length_is_cut_off_at_the_bound(server: Server) -> None:
    headers = {"Content-Type": "application/json", "Transfer-Encoding": "chunked",
               "Authorization": f"Bearer {server.admin_key}"}
    with raw_connection(server) as s:
        s.sendall(head("POST", "/v1/sandboxes", headers) + chunked(b'{"env": {"A": "', 1).__next__())
        # 64 MiB offered, 1 MiB at a time: the server must answer long before the end.
        _too_large(send_until_answered(s, chunked(b"a" * (1 << 20), 64), _deadline()))


@pytest.mark.parametrize("auth", ["none", "bogus"])
def test_authentication_happens_before_the_body_is_read(server: Server, auth: str) -> None:
    """A request with a small declared body that it never sends: without a valid key it is
    answered 401 at once (nothing waits for, or reads, its body)."""
    headers = {"Content-Type": "application/json", "Content-Length": "1000"}
    if auth == "bogus":
        headers["Authorization"] = "Bearer bogus"
    with raw_connection(server) as s:
        s.sendall(head("POST", "/v1/sandboxes", headers) + b'{"template"')
        answer = read_answer(s, _deadline())
    assert answer is not None, "no answer: the server waited for the body before authenticating"
    assert answer.status == 401, (answer.status, answer.body[:300])
    assert answer.error()["code"] == "unauthorized"


def test_an_upload_is_bounded_by_max_upload_as_it_streams(server: Server, sandbox: str) -> None:
    """The test server's --max-upload-mb is 64: a declared 2 GB upload is refused from its length,
    an undeclared one once 64 MiB have passed (streamed: nothing waits for the whole of it)."""
    auth = {"Authorization": f"Bearer {server.admin_key}"}
    path = f"/v1/sandboxes/{sandbox}/files?path=/tmp/big"
    with raw_connection(server) as s:
        s.sendall(head("PUT", path, {**auth, "Content-Length": str(TWO_GB)}) + b"x" * 1024)
        _too_large(read_answer(s, _deadline()))
    with raw_connection(server) as s:
        s.sendall(head("PUT", path, {**auth, "Transfer-Encoding": "chunked"}))
        _too_large(send_until_answered(s, chunked(b"y" * (1 << 20), 256), _deadline(180)))
    with server.client() as api:
        r = api.get(f"/v1/sandboxes/{sandbox}/files/stat", params={"path": "/tmp/big"})
        assert r.status_code == 404, r.text  # the cut-off upload left nothing behind


def test_stdin_is_bounded_as_it_is_read(server: Server, sandbox: str) -> None:
    """Stdin writes are limited to 16 MiB per request: a declared 17 MiB write is refused from its
    length (today it was read whole, then checked), an undeclared one once it passes 16 MiB."""
    with server.client() as api:
        r = api.post(f"/v1/sandboxes/{sandbox}/commands", json={"shell": "cat > /dev/null", "stdin": True})
        assert r.status_code == 201, r.text
        cid = r.json()["id"]
    auth = {"Authorization": f"Bearer {server.admin_key}"}
    path = f"/v1/sandboxes/{sandbox}/commands/{cid}/stdin"
    with raw_connection(server) as s:
        s.sendall(head("POST", path, {**auth, "Content-Length": str(17 << 20)}) + b"z" * (1 << 20))
        _too_large(read_answer(s, _deadline()))
    with raw_connection(server) as s:
        s.sendall(head("POST", path, {**auth, "Transfer-Encoding": "chunked"}))
        _too_large(send_until_answered(s, chunked(b"z" * (1 << 20), 64), _deadline()))
    with server.client() as api:  # what fits still goes through
        r = api.post(path, content=b"fits\n", params={"eof": "true"})
        assert r.status_code == 204, r.text


# ---- slow clients --------------------------------------------------------------------------------


def _cut_off(answer: RawAnswer | None, what: str) -> None:
    assert answer is not None, f"{what}: still held open after {SLOW_DEADLINE}s"
    # Answered 408 (the error schema) or closed without an answer.
    assert answer.status in (0, 408), (what, answer.status, answer.body[:300])
    if answer.status == 408:
        assert answer.error()["code"] == "request_timeout", what


def _idle(server: Server) -> RawAnswer | None:
    with raw_connection(server) as s:
        return read_answer(s, _deadline(SLOW_DEADLINE))


def _drip_headers(server: Server) -> RawAnswer | None:
    """Slowloris: a request line and headers one byte at a time, never finished."""
    deadline = _deadline(SLOW_DEADLINE)
    with raw_connection(server) as s:
        data = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 100_000
        for i in range(len(data)):
            try:
                s.sendall(data[i:i + 1])
            except (BrokenPipeError, ConnectionResetError):
                return read_answer(s, deadline)
            # The pace of the attack (a byte per half second), and the way to notice the close.
            if select.select([s], [], [], 0.5)[0] or time.monotonic() > deadline:
                return read_answer(s, deadline)
    return None


def _drip_after_refusal(server: Server) -> RawAnswer | None:
    """Refused from its length (413), the body is then dripped on: the server reads (and discards)
    it for a bounded time only."""
    deadline = _deadline(SLOW_DEADLINE)
    with raw_connection(server) as s:
        s.sendall(head("POST", "/v1/sandboxes", {"Content-Length": str(TWO_GB)}))
        first = read_answer(s, deadline)
        assert first is not None and first.status == 413, first and first.status
        while time.monotonic() < deadline:
            try:
                s.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                return RawAnswer(b"HTTP/1.1 0 closed\r\n\r\n")
            if select.select([s], [], [], 0.5)[0]:
                try:
                    if not s.recv(1):
                        return RawAnswer(b"HTTP/1.1 0 closed\r\n\r\n")
                except ConnectionResetError:
                    return RawAnswer(b"HTTP/1.1 0 closed\r\n\r\n")
    return None


def _short_body(server: Server, method: str, path: str, extra: dict[str, str]) -> RawAnswer | None:
    """Content-Length: 1000, then 19 bytes, then nothing."""
    headers = {"Authorization": f"Bearer {server.admin_key}", "Content-Length": "1000", **extra}
    with raw_connection(server) as s:
        s.sendall(head(method, path, headers) + b'{"metadata": {"a": ')
        return read_answer(s, _deadline(SLOW_DEADLINE))


def test_slow_clients_are_cut_off(server: Server, sandbox: str) -> None:
    cases = {
        "an idle connection": lambda: _idle(server),
        "headers dripped a byte at a time": lambda: _drip_headers(server),
        "a JSON body 19 bytes of 1000": lambda: _short_body(
            server, "PATCH", f"/v1/sandboxes/{sandbox}", {"Content-Type": "application/json"}),
        "an upload 19 bytes of 1000": lambda: _short_body(
            server, "PUT", f"/v1/sandboxes/{sandbox}/files?path=/tmp/slow", {}),
        "the rest of a refused body, dripped": lambda: _drip_after_refusal(server),
    }
    results: dict[str, RawAnswer | None] = {}
    threads = [threading.Thread(target=lambda k=k, f=f: results.__setitem__(k, f())) for k, f in cases.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SLOW_DEADLINE + 30)
    for what in cases:
        _cut_off(results.get(what), what)


def test_huge_headers_are_refused(server: Server) -> None:
    """The request line and headers are bounded (httptools has no limit of its own)."""
    with raw_connection(server) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        answer = send_until_answered(s, iter([b"b" * 65536] * 256), _deadline())
    assert answer is not None, "16 MiB of headers were taken in"
    assert answer.status in (0, 400, 431), (answer.status, answer.body[:200])


# ---- finding 10: bad input never reaches a 500 ---------------------------------------------------


@pytest.mark.parametrize("auth", [True, False], ids=["with-key", "without-key"])
@pytest.mark.parametrize("token", ["é", "\u2603" * 40, "\x00", "a" * 10_000], ids=["e-acute", "snowmen", "nul", "long"])
def test_an_attach_token_of_any_text_is_a_401(server: Server, token: str, auth: bool) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        headers = {"authorization": f"Bearer {server.admin_key}"} if auth else {}
        r = c.get("/v1/sandboxes/sb-x/commands/c-y/events", params={"token": token}, headers=headers)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "unauthorized"


# Ids the API passes on to the node, spelled as nothing SPACE ever names: control characters (the
# fuzz's 500: the node client refused to build the URL), dot segments, a query or fragment smuggled in.
_NOT_IDS = {"control": "d\x19\x06", "dot-dot": "..", "dot": ".", "query": "c?x=1", "fragment": "c#x",
            "percent": "c%2e%2e", "space": "c d", "non-ascii": "\u00e9"}


@pytest.mark.parametrize("cid", list(_NOT_IDS.values()), ids=list(_NOT_IDS))
@pytest.mark.parametrize("suffix", ["", "/events", "/signal"])
def test_an_id_that_is_no_path_segment_never_reaches_the_node(server: Server, sandbox: str, cid: str,
                                                             suffix: str) -> None:
    # Dots too (%2E): the test's own client would remove a literal dot segment before sending.
    quoted = urllib.parse.quote(cid, safe="").replace(".", "%2E")
    with server.client() as api:
        if suffix == "/signal":
            r = api.post(f"/v1/sandboxes/{sandbox}/commands/{quoted}/signal", json={"signal": "TERM"})
        else:
            r = api.get(f"/v1/sandboxes/{sandbox}/commands/{quoted}{suffix}")
        assert r.status_code == 404, (cid, r.status_code, r.text)
        assert r.json()["error"]["code"] == "not_found"
        assert api.get(f"/v1/sandboxes/{sandbox}").status_code == 200  # and the server is fine


def _big_int_requests(sandbox: str) -> list[tuple[str, str, dict[str, Any]]]:
    big = INT64_MAX + 1
    return [
        ("GET", f"/v1/sandboxes/{sandbox}/events", {"params": {"after": big}}),
        ("GET", "/v1/audit", {"params": {"after": big}}),
        ("GET", f"/v1/sandboxes/{sandbox}/commands/c-none/events", {"params": {"after": big}}),
        ("DELETE", "/v1/pools/base", {"params": {"memory_mb": big}}),
        ("PUT", "/v1/tenants/bounds/quota", {"json": {"sandboxes": big}}),
        ("PUT", "/v1/tenants/bounds/quota", {"json": {"memory_mb": big}}),
        ("PUT", "/v1/tenants/bounds/quota", {"json": {"storage_mb": 10 ** 30}}),
        ("GET", "/v1/audit", {"params": {"after": -big - 1}}),
    ]


def test_integers_beyond_the_store_are_422_at_the_edge(server: Server, sandbox: str) -> None:
    failures = []
    with server.client() as api:
        for method, path, kw in _big_int_requests(sandbox):
            r = api.request(method, path, **kw)
            if r.status_code != 422 or r.json().get("error", {}).get("code") != "validation_failed":
                failures.append((method, path, kw, r.status_code, r.text[:200]))
    assert not failures, failures


@pytest.mark.parametrize("value", [0, 1, "true", "yes", None], ids=["zero", "one", "string-true", "string-yes", "null"])
def test_booleans_are_booleans(server: Server, sandbox: str, value: object) -> None:
    with server.client() as api:
        before = api.get(f"/v1/sandboxes/{sandbox}").json()["auto_resume"]
        r = api.patch(f"/v1/sandboxes/{sandbox}", content=json.dumps({"auto_resume": value}),
                      headers={"content-type": "application/json"})
        after = api.get(f"/v1/sandboxes/{sandbox}").json()["auto_resume"]
    if value is None:  # null leaves it as it is (docs/api.md): not a coercion
        assert r.status_code == 200 and after == before, r.text
        return
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "validation_failed"
    assert after == before


def test_create_refuses_other_types_for_numbers_and_booleans(server: Server) -> None:
    with server.client() as api:
        for body in ({"memory_mb": "512"}, {"memory_mb": 512.5}, {"public_ports": 1}, {"cpu": "1"},
                     {"memory_mb": True}):
            r = api.post("/v1/sandboxes", json={"template": "no-such-template", **body})
            assert r.status_code == 422, (body, r.text)


def test_wait_on_an_operation_is_bounded_in_its_type(server: Server) -> None:
    with server.client() as api:
        r = api.get("/v1/operations/op-none", params={"wait": "1e309"})
        assert r.status_code == 422, r.text


def test_the_server_keeps_serving(server: Server) -> None:
    """After all of the above the server answers as usual (nothing it was sent broke it)."""
    wait_for(lambda: httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200, 60, "/healthz")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head("GET", "/healthz", {}))
        answer = read_answer(s, _deadline())
        assert answer is not None and answer.status == 200


# ---- the document and the models: the class, not the instances --------------------------------


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def _resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str):
        target: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        return dict(target)
    return node


def test_the_document_says_what_the_server_sends(server: Server) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", timeout=60).json()
    error = doc["components"]["schemas"].get("Error")
    assert error is not None and "error" in error["properties"], "no error schema"
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    problems = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            responses = op["responses"]
            has_input = bool(op.get("parameters")) or "requestBody" in op
            if path.startswith("/v1/"):
                for status in ("401", "500", *(("400", "422") if has_input else ())):
                    if status not in responses:
                        problems.append(f"{method} {path}: {status} undocumented")
            for status, resp in responses.items():
                if status.startswith(("4", "5")):
                    schema = resp.get("content", {}).get("application/json", {}).get("schema")
                    if schema != {"$ref": "#/components/schemas/Error"}:
                        problems.append(f"{method} {path}: {status} is not the error schema: {schema}")
    assert not problems, "\n".join(problems)

    def media(path: str, method: str = "get") -> list[str]:
        return list(doc["paths"][path][method]["responses"]["200"]["content"])

    assert media("/v1/sandboxes/{sandbox_id}/commands/{cid}/events") == ["text/event-stream",
                                                                         "application/x-space-events"]
    assert media("/v1/operations/{op_id}/logs") == ["text/event-stream"]
    assert media("/v1/sandboxes/{sandbox_id}/files") == ["application/octet-stream"]
    assert "201" in doc["paths"]["/v1/sandboxes"]["post"]["responses"]


def test_every_integer_the_api_takes_is_bounded_by_the_store(server: Server) -> None:
    """Every integer of every parameter and request body has bounds within a signed 64-bit
    integer (what SQLite and PostgreSQL hold), so a bigger one is a 422, not an OverflowError."""
    doc = httpx.get(f"{server.url}/openapi.json", timeout=60).json()
    inputs: list[tuple[str, Any]] = []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            for p in op.get("parameters") or []:
                inputs.append((f"{method} {path} {p['in']}:{p['name']}", p.get("schema")))
            for media_type in (op.get("requestBody") or {}).get("content", {}).values():
                inputs.append((f"{method} {path} body", media_type.get("schema")))
    unbounded = []
    for where, schema in inputs:
        todo, seen = [schema], set()
        while todo:
            node = todo.pop()
            if not isinstance(node, dict):
                continue
            node = _resolve(doc, node)
            key = repr(sorted(node.items(), key=str))
            if key in seen:
                continue
            seen.add(key)
            if node.get("type") == "integer":
                lo = node.get("minimum", node.get("exclusiveMinimum"))
                hi = node.get("maximum", node.get("exclusiveMaximum"))
                if lo is None or hi is None or lo < -INT64_MAX - 1 or hi > INT64_MAX:
                    unbounded.append(f"{where}: {node}")
            todo.extend(d for d in _walk({k: v for k, v in node.items()}) if d is not node)
    assert not unbounded, "\n".join(unbounded)


def _request_models() -> list[type[Any]]:
    """The body models of every route of SPACE's API (each ``space.api`` module's router)."""
    import importlib
    import pkgutil

    from fastapi import APIRouter
    from fastapi.routing import APIRoute
    from pydantic import BaseModel

    import space.api

    found: dict[str, type[Any]] = {}
    for info in pkgutil.iter_modules(space.api.__path__):
        router = getattr(importlib.import_module(f"space.api.{info.name}"), "router", None)
        if not isinstance(router, APIRouter):
            continue
        for route in router.routes:
            if not isinstance(route, APIRoute) or route.body_field is None:
                continue
            todo = [route.body_field.field_info.annotation]
            while todo:
                t = todo.pop()
                if isinstance(t, type) and issubclass(t, BaseModel):
                    if t.__name__ not in found:
                        found[t.__name__] = t
                        todo.extend(f.annotation for f in t.model_fields.values())
                else:
                    todo.extend(getattr(t, "__args__", ()))
    return list(found.values())


def _scalars(annotation: Any, metadata: list[Any]) -> Iterator[tuple[type, list[Any]]]:
    """The bool/int/float types within a field's annotation, each with the metadata that applies
    to it (an ``Annotated``'s own, then the field's: pydantic applies them in that order)."""
    import types
    import typing

    if typing.get_origin(annotation) is typing.Annotated:
        yield from _scalars(annotation.__origin__, [*annotation.__metadata__, *metadata])
    elif annotation in (bool, int, float):
        yield annotation, metadata
    elif typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            yield from _scalars(arg, metadata)
    else:
        for arg in typing.get_args(annotation):  # list[int], dict[str, int]: the field's bounds are not theirs
            yield from _scalars(arg, [])


def test_every_number_and_boolean_of_a_body_is_strict_and_keeps_its_bounds() -> None:
    """Strict types (no coercion of 0 to false, of "5" to 5) in every request model, and the
    narrowest bound of each field is the one in force (given as ``x: Int64 = Field(ge=...)``,
    pydantic lets the shared type's own bounds win over the field's)."""
    import annotated_types as at
    from pydantic import Strict

    models = _request_models()
    assert len(models) > 15, [m.__name__ for m in models]
    problems = []
    for model in models:
        for name, field in model.model_fields.items():
            where = f"{model.__name__}.{name}"
            for scalar, meta in _scalars(field.annotation, list(field.metadata)):
                if not any(isinstance(m, Strict) and m.strict for m in meta):
                    problems.append(f"{where}: {scalar.__name__} is not strict")
                bounds = ((at.Ge, "ge", max), (at.Gt, "gt", max), (at.Le, "le", min), (at.Lt, "lt", min))
                for kind, attr, pick in bounds:
                    values = [getattr(m, attr) for m in meta if isinstance(m, kind)]
                    if values and values[-1] != pick(values):
                        problems.append(f"{where}: its {attr}={pick(values)} is overridden by {values[-1]}")
    assert not problems, "\n".join(problems)
