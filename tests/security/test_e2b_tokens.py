"""Issue 13, findings 4 and 9 (signed URLs): the E2B facade's tokens grant no more than their holder's
role, the traffic token opens ports only, tokens rotate (on demand, on delete, with the sandbox's
row), and a signed ``/files`` URL is checked against one sandbox only.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import delete

from space.lifecycle import State
from space.store import Sandbox, Store
from tests.conftest import E2B_TEST_DOMAIN
from tests.e2e import e2b_env
from tests.e2e.harness import Server, runtime_available
from tests.security import e2b_fixtures as fx
from tests.store.storekit import new_op, new_sandbox
from tests.waiting import wait_for

e2b = pytest.importorskip("e2b")

from e2b.sandbox.signature import get_signature  # noqa: E402 -- after the importorskip


@pytest.fixture(scope="module")
def made(server: Server) -> Iterator[e2b_env.Sandboxes]:
    with pytest.MonkeyPatch.context() as mp:
        e2b_env.point_sdk_at(mp, server)
        yield from e2b_env.sandboxes()


@pytest.fixture(scope="module")
def keys(server: Server) -> fx.Keys:
    return fx.keys(server)


@pytest.fixture(scope="module")
def private(made: e2b_env.Sandboxes, server: Server) -> Any:
    """A sandbox with private ports and a server on its port 8000."""
    sbx = e2b.Sandbox.create(timeout=1800, network={"allow_public_traffic": False})
    made.add(sbx.sandbox_id)
    sbx.files.write("/home/user/srv.py", fx.PORT_SERVER)
    sbx.files.write("/home/user/secret.txt", "the tenant's secret")
    sbx.commands.run("python3 /home/user/srv.py", background=True, timeout=0)
    wait_for(lambda: _port(server, sbx.sandbox_id, sbx.traffic_access_token).status_code == 200, timeout=60,
             what="the server in the sandbox")
    return sbx


def _port(server: Server, sandbox_id: str, traffic: str) -> httpx.Response:
    return fx.port_request(server, sandbox_id, {"E2B-Traffic-Access-Token": traffic})


def _stat(server: Server, sandbox_id: str, token: str) -> httpx.Response:
    return fx.rpc(server, sandbox_id, "filesystem.Filesystem/Stat", {"path": "/home/user"},
                  {"X-Access-Token": token})


def _control(server: Server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"X-API-KEY": key}, timeout=120)


# -- finding 4: what each role gets ---------------------------------------------------------------


@pytest.mark.runtime
@pytest.mark.skipif(runtime_available() is not None, reason=str(runtime_available()))
def test_a_readonly_key_gets_no_token(server: Server, private: Any, keys: fx.Keys) -> None:
    sid, envd, traffic = private.sandbox_id, private._envd_access_token, private.traffic_access_token
    with _control(server, keys.readonly) as ro:
        info = ro.get(f"/sandboxes/{sid}")
        assert info.status_code == 200 and info.json()["sandboxID"] == sid
        assert "envdAccessToken" not in info.json() and "trafficAccessToken" not in info.json()
        listed = ro.get("/v2/sandboxes")
        assert listed.status_code == 200 and sid in listed.text
        for r in (info, listed):
            assert envd not in r.text and traffic not in r.text
        # Every call that answers tokens needs a key that may write.
        for path, body in ((f"/sandboxes/{sid}/connect", {"timeout": 600}),
                           (f"/v2/sandboxes/{sid}/connect", {"timeout": 600}),
                           (f"/sandboxes/{sid}/resume", {"timeout": 600}),
                           (f"/sandboxes/{sid}/fork", {"count": 1}),
                           (f"/sandboxes/{sid}/tokens/rotate", None)):
            r = ro.post(path, json=body)
            assert r.status_code == 403, (path, r.status_code, r.text)
            assert envd not in r.text and traffic not in r.text
    # The official SDK's get_info works with a readonly key: it just has no token to hand out.
    got = e2b.Sandbox.get_info(sid, api_key=keys.readonly)
    assert got.sandbox_id == sid
    # A key that may write still gets the sandbox's token from get_info (E2B's shape).
    with _control(server, keys.member) as member:
        assert member.get(f"/sandboxes/{sid}").json()["envdAccessToken"] == envd


@pytest.mark.runtime
@pytest.mark.skipif(runtime_available() is not None, reason=str(runtime_available()))
def test_the_traffic_token_opens_ports_only(server: Server, private: Any) -> None:
    sid, envd, traffic = private.sandbox_id, private._envd_access_token, private.traffic_access_token
    assert traffic and envd and traffic != envd
    assert _port(server, sid, traffic).status_code == 200
    # A preview link's token is refused by every envd route: RPCs, /files both ways, signed URLs.
    r = _stat(server, sid, traffic)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = fx.start_process(server, sid, {"X-Access-Token": traffic})
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = httpx.get(f"{server.url}/files", params={"path": "/home/user/secret.txt"},
                  headers=fx.envd_headers(sid, **{"X-Access-Token": traffic}))
    assert r.status_code == 401 and "the tenant's secret" not in r.text
    r = httpx.post(f"{server.url}/files", params={"path": "/home/user/pwned"}, content=b"x",
                   headers=fx.envd_headers(sid, **{"X-Access-Token": traffic,
                                                   "Content-Type": "application/octet-stream"}))
    assert r.status_code == 401
    sig = get_signature("/home/user/secret.txt", "read", None, traffic)["signature"]
    r = httpx.get(f"{server.url}/files", params={"path": "/home/user/secret.txt", "signature": sig},
                  headers=fx.envd_headers(sid))
    assert r.status_code == 401 and "the tenant's secret" not in r.text
    # The envd token is what envd takes.
    assert _stat(server, sid, envd).status_code == 200
    assert private.files.exists("/home/user/pwned") is False


# -- finding 4: rotation ------------------------------------------------------------------------------


@pytest.mark.runtime
@pytest.mark.skipif(runtime_available() is not None, reason=str(runtime_available()))
def test_rotation_revokes_both_tokens_at_once(server: Server, made: e2b_env.Sandboxes, keys: fx.Keys) -> None:
    sbx = e2b.Sandbox.create(timeout=1800, network={"allow_public_traffic": False})
    made.add(sbx.sandbox_id)
    sid = sbx.sandbox_id
    sbx.files.write("/home/user/srv.py", fx.PORT_SERVER)
    sbx.files.write("/home/user/f.txt", "rotated")
    sbx.commands.run("python3 /home/user/srv.py", background=True, timeout=0)
    wait_for(lambda: _port(server, sid, sbx.traffic_access_token).status_code == 200, timeout=60,
             what="the server in the sandbox")
    old_envd, old_traffic = sbx._envd_access_token, sbx.traffic_access_token
    old_url = sbx.download_url("/home/user/f.txt")
    assert httpx.get(old_url, headers={"E2b-Sandbox-Id": sid}).status_code == 200

    # Who may rotate: not a readonly key, not another tenant.
    with _control(server, keys.readonly) as ro:
        assert ro.post(f"/sandboxes/{sid}/tokens/rotate").status_code == 403
    with _control(server, keys.other_tenant) as other:
        assert other.post(f"/sandboxes/{sid}/tokens/rotate").status_code == 404
    assert _stat(server, sid, old_envd).status_code == 200  # nothing changed

    with _control(server, keys.member) as member:
        r = member.post(f"/sandboxes/{sid}/tokens/rotate")
    assert r.status_code == 200, r.text
    fresh = r.json()
    new_envd, new_traffic = fresh["envdAccessToken"], fresh["trafficAccessToken"]
    assert fresh["sandboxID"] == sid and new_envd != old_envd and new_traffic != old_traffic
    # The old ones stop working at once, everywhere; the new ones work.
    assert _stat(server, sid, old_envd).status_code == 401
    assert _port(server, sid, old_traffic).status_code == 403  # a port's refusal is E2B's 403
    assert httpx.get(old_url, headers={"E2b-Sandbox-Id": sid}).status_code == 401
    assert _stat(server, sid, new_envd).status_code == 200
    assert _port(server, sid, new_traffic).status_code == 200
    # The SDK picks the new token up on connect, as after any reconnect.
    again = e2b.Sandbox.connect(sid)
    assert again._envd_access_token == new_envd and again.files.read("/home/user/f.txt") == "rotated"
    # An admin key rotates too.
    with _control(server, keys.admin) as admin:
        assert admin.post(f"/sandboxes/{sid}/tokens/rotate").status_code == 200
    assert _stat(server, sid, new_envd).status_code == 401


@pytest.mark.runtime
@pytest.mark.skipif(runtime_available() is not None, reason=str(runtime_available()))
def test_a_killed_sandbox_still_answers_not_found(server: Server, made: e2b_env.Sandboxes) -> None:
    """Its tokens are rotated by the delete, yet the SDK still learns "not found", not "unauthenticated"."""
    sbx = e2b.Sandbox.create(timeout=600)
    made.add(sbx.sandbox_id)
    token = sbx._envd_access_token
    assert sbx.kill() is True
    r = _stat(server, sbx.sandbox_id, token)
    assert r.status_code == 502 and "was not found" in r.json()["message"]
    with pytest.raises(e2b.SandboxException):
        sbx.files.read("/etc/hostname")


# -- finding 4: tokens are bound to one sandbox row ------------------------------------------------------


@pytest.fixture
async def store(tmp_path: Path) -> Any:
    st = await Store.open(f"sqlite+aiosqlite:///{tmp_path}/space.db")
    try:
        yield st
    finally:
        await st.close()


@pytest.mark.anyio
async def test_tokens_die_with_the_sandbox_and_never_serve_its_id_again(store: Store) -> None:
    from space.e2b import tokens

    secret = b"k" * 32
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    sb = await store.get_sandbox(sb.id)
    envd, traffic = tokens.envd_token(secret, sb), tokens.traffic_token(secret, sb)
    assert tokens.check_envd(secret, sb, envd) and tokens.check_traffic(secret, sb, traffic)
    # Different credentials: neither passes for the other.
    assert not tokens.check_envd(secret, sb, traffic) and not tokens.check_traffic(secret, sb, envd)
    # Rotation: a fresh nonce, the old tokens are void.
    rotated = await store.update_sandbox(sb.id, token_nonce=tokens.fresh_nonce())
    assert not tokens.check_envd(secret, rotated, envd) and not tokens.check_traffic(secret, rotated, traffic)
    live = tokens.envd_token(secret, rotated)
    # Deleting it rotates them again (whatever path deletes: the state change does it).
    gone = await store.set_sandbox_state(sb.id, State.TERMINATING)
    assert not tokens.check_envd(secret, gone, live)
    # The id used again (a row deleted and made anew, as after a restore of the database): the
    # tokens of the old row never pass for the new one.
    async with store._sessionmaker() as s, s.begin():
        await s.execute(delete(Sandbox).where(Sandbox.id == sb.id))
    reborn, _, _ = await store.create_sandbox(new_sandbox(id=sb.id), new_op())
    reborn = await store.get_sandbox(reborn.id)
    for old in (envd, live):
        assert not tokens.check_envd(secret, reborn, old)
    assert not tokens.check_traffic(secret, reborn, traffic)


@pytest.mark.anyio
async def test_the_delete_the_api_makes_rotates_the_tokens(store: Store) -> None:
    """The API deletes through start_operation (the state change and its operation in one write):
    the tokens must die there too, not only in set_sandbox_state."""
    from space.e2b import tokens

    secret = b"k" * 32
    sb, _, _ = await store.create_sandbox(new_sandbox(), new_op())
    sb = await store.get_sandbox(sb.id)
    envd, traffic = tokens.envd_token(secret, sb), tokens.traffic_token(secret, sb)
    deleting = new_op(kind="sandbox.delete", target=sb.id)
    gone, _, created = await store.start_operation(deleting, move_to=State.TERMINATING, expect=[sb.state])
    assert created and gone.state == State.TERMINATING
    assert not tokens.check_envd(secret, gone, envd) and not tokens.check_traffic(secret, gone, traffic)
    assert not tokens.check_envd(secret, await store.get_sandbox(sb.id), envd)


def test_token_checks_take_any_input() -> None:
    """Constant-time compares of bytes: a non-ASCII or huge token is a plain refusal."""
    from space.e2b import tokens

    sb = new_sandbox(token_nonce=tokens.fresh_nonce())
    for bad in ("", "ea_é", "ea_" + "A" * 100_000, "\x00", tokens.envd_token(b"other-secret", sb)):
        assert not tokens.check_envd(b"k" * 32, sb, bad)
        assert not tokens.check_traffic(b"k" * 32, sb, bad)


# -- finding 9: a signed URL is checked against the one sandbox it names ---------------------------------


@pytest.mark.runtime
@pytest.mark.skipif(runtime_available() is not None, reason=str(runtime_available()))
def test_a_signed_url_names_its_sandbox(server: Server, private: Any, made: e2b_env.Sandboxes) -> None:
    sid = private.sandbox_id
    url = private.download_url("/home/user/secret.txt")  # E2B_SANDBOX_URL: the URL names no sandbox
    assert sid not in url
    # Without a sandbox it is refused at once (it used to be hashed against every live sandbox).
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url)
    assert err.value.code == 401
    assert "names no sandbox" in err.value.read().decode()
    # Named by a header, by a query parameter (a link for a browser), or by host: one check.
    assert httpx.get(url, headers={"E2b-Sandbox-Id": sid}).text == "the tenant's secret"
    with urllib.request.urlopen(f"{url}&sandbox_id={sid}") as resp:
        assert resp.read().decode() == "the tenant's secret"
    # Another sandbox's signature names the wrong sandbox: refused, never searched for.
    other = e2b.Sandbox.create(timeout=600)
    made.add(other.sandbox_id)
    foreign = other.download_url("/home/user/secret.txt")
    r = httpx.get(f"{foreign}&sandbox_id={sid}")
    assert r.status_code == 401 and r.json()["message"] == "invalid signature"
    # Bounded: a signature of the wrong shape is refused before any hashing.
    r = httpx.get(f"{server.url}/files", params={"path": "x", "signature": "v1_" + "A" * 10_000, "sandbox_id": sid})
    assert r.status_code == 401 and r.json()["message"] == "invalid signature"


@pytest.mark.runtime
@pytest.mark.skipif(runtime_available() is not None, reason=str(runtime_available()))
def test_an_expired_signature_is_refused_however_the_sandbox_is_named(server: Server, private: Any) -> None:
    """A guard, as the check moved: the expiration holds whichever way the URL names its sandbox."""
    sid = private.sandbox_id
    expired = private.download_url("/home/user/secret.txt", use_signature_expiration=-120)
    for r in (httpx.get(expired, headers={"E2b-Sandbox-Id": sid}),
              httpx.get(expired, headers={"Host": f"49983-{sid}.{E2B_TEST_DOMAIN}"})):
        assert r.status_code == 401 and r.json() == {"code": 401, "message": "signature is already expired"}
        assert "the tenant's secret" not in r.text
