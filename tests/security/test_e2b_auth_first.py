"""Issue 13, finding 5: a request that does not authenticate has no effect.

One paused sandbox (auto-resume on, private ports, as E2B users make them) and, for every route
family that reaches it (envd's RPCs, ``/files``, signed URLs, ``/health``, its ports by header and by
host name, E2B's control API, SPACE's own data plane), requests with no credential, a wrong one, or
one that is not this family's (the port-only traffic token on envd, a read-only key where a write
is needed, another tenant's key). After each the sandbox must still be paused, its last activity
unchanged (the idle timer not refreshed), its policies and events as they were, and the audit must
show no call about it that succeeded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import E2B_TEST_DOMAIN
from tests.e2e import e2b_env
from tests.e2e.harness import Server, runtime_available
from tests.security import e2b_fixtures as fx
from tests.waiting import wait_for

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(runtime_available() is not None,
                                                      reason=str(runtime_available()))]

e2b = pytest.importorskip("e2b")

from e2b.sandbox.signature import get_signature  # noqa: E402 -- after the importorskip


class Paused:
    """The module's sandbox and the credentials the requests use."""

    def __init__(self, sbx: Any, keys: fx.Keys) -> None:
        self.sbx = sbx
        self.id: str = sbx.sandbox_id
        self.envd_token: str = sbx._envd_access_token
        self.traffic_token: str = sbx.traffic_access_token
        self.keys = keys


@pytest.fixture(scope="module")
def target(server: Server) -> Iterator[Paused]:
    with pytest.MonkeyPatch.context() as mp:
        e2b_env.point_sdk_at(mp, server)
        made = e2b_env.Sandboxes()
        try:
            sbx = e2b.Sandbox.create(timeout=3600, lifecycle={"on_timeout": "pause", "auto_resume": True},
                                     network={"allow_public_traffic": False})
            made.add(sbx.sandbox_id)
            assert sbx.traffic_access_token and sbx._envd_access_token
            sbx.files.write("/home/user/srv.py", fx.PORT_SERVER)
            sbx.commands.run("python3 /home/user/srv.py", background=True, timeout=0)
            h = {"e2b-traffic-access-token": sbx.traffic_access_token}
            wait_for(lambda: fx.port_request(server, sbx.sandbox_id, h).status_code == 200, timeout=60,
                     what="the server in the sandbox")
            yield Paused(sbx, fx.keys(server))
        finally:
            made.kill_all()


@pytest.fixture
def paused(server: Server, target: Paused) -> fx.Seen:
    """The sandbox paused (again, if a request woke it), and how it looks now."""
    if fx.seen(server, target.id).state != "paused":
        assert target.sbx.pause() is True
    before = fx.seen(server, target.id)
    assert before.state == "paused"
    return before


# -- the requests -----------------------------------------------------------------------------------

Send = Callable[[Server, Paused], httpx.Response]


def _envd_creds(p: Paused, cred: str) -> dict[str, str]:
    return {"none": {}, "wrong": {"X-Access-Token": "ea_" + "A" * 32},
            # The port-only token where envd's is expected, and beside none.
            "traffic": {"X-Access-Token": p.traffic_token},
            "traffic-header": {"E2B-Traffic-Access-Token": p.traffic_token}}[cred]


def _signed(server: Server, p: Paused, cred: str) -> httpx.Response:
    params = {"path": "/etc/hostname", "sandbox_id": p.id}
    token = {"wrong": "ea_" + "A" * 32, "traffic": p.traffic_token}.get(cred)
    if token is not None:
        params["signature"] = get_signature("/etc/hostname", "read", None, token)["signature"]
    return httpx.get(f"{server.url}/files", params=params, timeout=120)


ENVD: dict[str, Callable[[Server, Paused, dict[str, str]], httpx.Response]] = {
    "process-start": lambda s, p, h: fx.start_process(s, p.id, h),
    "process-list": lambda s, p, h: fx.rpc(s, p.id, "process.Process/List", {}, h),
    "filesystem-stat": lambda s, p, h: fx.rpc(s, p.id, "filesystem.Filesystem/Stat", {"path": "/"}, h),
    "files-download": lambda s, p, h: httpx.get(f"{s.url}/files", params={"path": "/etc/hostname"},
                                                headers={**fx.envd_headers(p.id), **h}, timeout=120),
    "files-upload": lambda s, p, h: httpx.post(f"{s.url}/files", params={"path": "/tmp/pwned"}, content=b"x",
                                               headers={**fx.envd_headers(p.id), **h,
                                                        "Content-Type": "application/octet-stream"},
                                               timeout=120),
    "health": lambda s, p, h: httpx.get(f"{s.url}/health", headers={**fx.envd_headers(p.id), **h}, timeout=120),
}

PORT_CREDS = {"none": {}, "wrong-traffic": {"E2B-Traffic-Access-Token": "ta_" + "A" * 32},
              "wrong-envd": {"X-Access-Token": "ea_" + "A" * 32}}


def _by_host(server: Server, p: Paused, h: dict[str, str]) -> httpx.Response:
    return httpx.get(f"{server.url}/", headers={"Host": f"8000-{p.id}.{E2B_TEST_DOMAIN}", **h}, timeout=120)


def _control_key(p: Paused, cred: str) -> dict[str, str]:
    return {"none": {}, "wrong": {"X-API-KEY": "sk-not-a-key"}, "readonly": {"X-API-KEY": p.keys.readonly},
            "other-tenant": {"X-API-KEY": p.keys.other_tenant}}[cred]


CONTROL: dict[str, tuple[str, str, dict[str, Any] | None]] = {
    "connect-v2": ("POST", "/v2/sandboxes/{id}/connect", {"timeout": 600}),
    "connect-v1": ("POST", "/sandboxes/{id}/connect", {"timeout": 600}),
    # With autoPause: a readonly key must not change the sandbox's timeout action on its way to a 403.
    "resume": ("POST", "/sandboxes/{id}/resume", {"timeout": 600, "autoPause": False}),
    "set-timeout": ("POST", "/sandboxes/{id}/timeout", {"timeout": 5}),
    "fork": ("POST", "/sandboxes/{id}/fork", {"count": 1}),
    "network": ("PUT", "/sandboxes/{id}/network", {"allowOut": ["1.1.1.1"]}),
    "kill": ("DELETE", "/sandboxes/{id}", None),
}


def _space_key(p: Paused, cred: str) -> dict[str, str]:
    return {"none": {}, "wrong": {"Authorization": "Bearer sk-not-a-key"},
            "readonly": {"Authorization": f"Bearer {p.keys.readonly}"},
            "other-tenant": {"Authorization": f"Bearer {p.keys.other_tenant}"}}[cred]


#: SPACE's own data plane: reads a readonly key may make, which must not wake the sandbox either.
SPACE_READS = {
    "commands-list": "/v1/sandboxes/{id}/commands",
    "files-list": "/v1/sandboxes/{id}/files/list?path=/",
    "files-stat": "/v1/sandboxes/{id}/files/stat?path=/",
    "files-download": "/v1/sandboxes/{id}/files?path=/etc/hostname",
    "ports-get": "/v1/sandboxes/{id}/ports/8000/",
}


def _cases() -> list[Any]:
    cases: list[Any] = []
    for family, send in ENVD.items():
        for cred in ("none", "wrong", "traffic", "traffic-header"):
            cases.append(pytest.param(lambda s, p, send=send, cred=cred: send(s, p, _envd_creds(p, cred)),
                                      id=f"envd-{family}-{cred}"))
    for cred in ("none", "wrong", "traffic"):
        cases.append(pytest.param(lambda s, p, cred=cred: _signed(s, p, cred), id=f"signed-url-{cred}"))
    for cred, h in PORT_CREDS.items():
        cases.append(pytest.param(lambda s, p, h=h: fx.port_request(s, p.id, h), id=f"port-header-{cred}"))
        cases.append(pytest.param(lambda s, p, h=h: fx.port_request(s, p.id, h, "POST"), id=f"port-post-{cred}"))
        cases.append(pytest.param(lambda s, p, h=h: _by_host(s, p, h), id=f"port-host-{cred}"))
    for name, (method, path, body) in CONTROL.items():
        for cred in ("none", "wrong", "readonly", "other-tenant"):
            cases.append(pytest.param(
                lambda s, p, method=method, path=path, body=body, cred=cred: httpx.request(
                    method, s.url + path.format(id=p.id), json=body, headers=_control_key(p, cred), timeout=120),
                id=f"control-{name}-{cred}"))
    for name, path in SPACE_READS.items():
        for cred in ("none", "wrong", "readonly", "other-tenant"):
            cases.append(pytest.param(
                lambda s, p, path=path, cred=cred: httpx.get(s.url + path.format(id=p.id),
                                                             headers=_space_key(p, cred), timeout=120),
                id=f"space-{name}-{cred}"))
    return cases


@pytest.mark.parametrize("send", _cases())
def test_a_request_that_does_not_authenticate_has_no_effect(server: Server, target: Paused, paused: fx.Seen,
                                                            send: Send) -> None:
    r = send(server, target)
    assert r.status_code >= 400, f"answered {r.status_code}: {r.text[:300]}"
    after = fx.seen(server, target.id)
    assert after.state == "paused", f"the request woke the sandbox (answer {r.status_code}: {r.text[:200]})"
    assert after.last_active_at == paused.last_active_at, "the request refreshed the sandbox's idle timer"
    assert after.on_expire == paused.on_expire, "the request changed the sandbox's timeout action"
    assert after.events == paused.events, "the request left events on the sandbox"
    assert fx.effects_since(server, target.id, paused) == [], "the audit shows a call that succeeded"


def test_the_right_credential_still_wakes_it(server: Server, target: Paused, paused: fx.Seen) -> None:
    """The other side: with its envd token, traffic to the auto-resuming sandbox wakes it."""
    r = fx.rpc(server, target.id, "filesystem.Filesystem/Stat", {"path": "/"}, {"X-Access-Token": target.envd_token})
    assert r.status_code == 200, r.text
    assert fx.seen(server, target.id).state == "running"
    assert target.sbx.pause() is True
    r = fx.port_request(server, target.id, {"E2B-Traffic-Access-Token": target.traffic_token})
    assert r.status_code == 200 and r.text == "ok"
    assert fx.seen(server, target.id).state == "running"
