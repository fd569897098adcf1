"""Many machines, one platform: 2 API replicas, 2 controllers and 3 node agents (each its own pool),
over one PostgreSQL database and moto's S3 server, nodes joined with join tokens and reached over
mutual TLS (tests/e2e/cluster.py).

- every node joins and is ready; any replica lists them with their certificate identity
- a sandbox created on replica A is driven from replica B: exec streamed over SSE, files both ways
- a server in it is reached through either replica, over HTTP and over a WebSocket
- a replica SIGKILLed mid-stream costs one reconnect: the other resumes with Last-Event-ID, no gap
  and no repeat
- a node refuses callers without a control-plane certificate of its cluster: a stolen bearer token,
  a certificate of another cluster CA, another node's certificate
- the controller running an operation is SIGKILLed mid-operation: the other takes it over and it
  finishes exactly once (one sandbox, on one node); the leader is SIGKILLed: the other leads
- 50 concurrent creates across both replicas by a tenant allowed 40: 40 exist, each exactly once,
  the other 10 are refused
- a node holding ten sandboxes (counting in memory, one paused, one followed by the SDK) is drained
  while the controller carrying a move is SIGKILLed: all ten run elsewhere exactly once, counting on,
  the paused one paused, the stream without a gap; with nowhere to go a drain is refused
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import re
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from space.cluster.pki import ClusterCA
from tests.e2e.cluster import Cluster, Proc, cluster
from tests.e2e.harness import (
    LOUD_COUNTER,
    SPACE,
    counter_numbers,
    create_sandbox,
    free_port,
    read_events,
    run,
    runtime_available,
    wait_operation,
)
from tests.waiting import wait_for

pytestmark = [pytest.mark.runtime, pytest.mark.postgres]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, postgres_url: str) -> Iterator[Cluster]:
    reason = runtime_available()
    if reason:
        pytest.skip(reason)
    import anyio

    from tests.store.conftest import reset_postgres

    anyio.run(reset_postgres, postgres_url)
    work = tmp_path_factory.mktemp("cluster")
    with cluster(work, postgres_url) as c:
        yield c


def sql(c: Cluster, query: str, **params: Any) -> list[Any]:
    """A plain query against the deployment's database (what the test reads behind the API)."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    async def go() -> list[Any]:
        engine = create_async_engine(c.database_url)
        try:
            async with engine.connect() as conn:
                return list((await conn.execute(text(query), params)).all())
        finally:
            await engine.dispose()

    return asyncio.run(go())


def _delete(api: httpx.Client, sid: str) -> None:
    r = api.delete(f"/v1/sandboxes/{sid}")
    if r.status_code == 202:
        assert wait_operation(api, r.json()["operation"]["id"])["status"] == "succeeded"


def node_sandboxes(c: Cluster) -> dict[str, list[str]]:
    """Each node's own list of its sandboxes, asked over mutual TLS."""
    out = {}
    for n in c.nodes:
        with c.node_client(n) as nc:
            r = nc.get("/v1/sandboxes")
            r.raise_for_status()
            out[n.node_id] = [s["id"] for s in r.json()["sandboxes"]]
    return out


def test_every_node_joined_over_mutual_tls(deployment: Cluster) -> None:
    for i in range(2):
        with deployment.client(i) as api:
            nodes = {n["id"]: n for n in api.get("/v1/nodes").json()["nodes"]}
        assert set(nodes) == {"node-a", "node-b", "node-c"}
        for n in nodes.values():
            assert (n["state"], n["identity"]) == ("ready", "certificate"), n
            assert n["url"].startswith("https://127.0.0.1:") and n["version"]
            assert n["capacity"]["cpus"] and n["capacity"]["memory_mb"], n
    with deployment.client(1) as api:
        tokens = api.get("/v1/nodes/tokens").json()["tokens"]
    assert sorted(t["uses"] for t in tokens) == [1, 1, 1]


def test_a_sandbox_made_on_one_replica_is_driven_from_the_other(deployment: Cluster) -> None:
    with deployment.client(0) as a, deployment.client(1) as b:
        sid = create_sandbox(a)
        try:
            assert b.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
            code, out, _ = run(b, sid, {"shell": "echo from-$((40 + 2))"})
            assert (code, out) == (0, b"from-42\n")
            blob = bytes(range(256)) * 4096  # 1 MiB, every byte value
            assert a.put(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/blob"},
                         content=blob).status_code in (200, 201, 204)
            got = b.get(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/blob"})
            assert got.status_code == 200 and got.content == blob
            assert b.put(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/back"},
                         content=b"written on B").status_code in (200, 201, 204)
            assert a.get(f"/v1/sandboxes/{sid}/files", params={"path": "/home/user/back"}).content == b"written on B"
        finally:
            _delete(a, sid)


def test_a_port_over_http_and_websocket_through_either_replica(deployment: Cluster) -> None:
    from websockets.sync.client import connect

    from tests.e2e.test_port_websockets import PORT
    from tests.e2e.test_port_websockets import SERVER as WS_SERVER

    with deployment.client(0) as a, deployment.client(1) as b:
        sid = create_sandbox(a)
        try:
            a.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/ws.py"}, content=WS_SERVER.encode())
            a.put(f"/v1/sandboxes/{sid}/files", params={"path": "/tmp/www/hi.txt"}, content=b"over mTLS\n")
            for cmd in (["python3", "/tmp/ws.py"],
                        ["python3", "-m", "http.server", "8000", "--bind", "0.0.0.0", "--directory", "/tmp/www"]):
                assert a.post(f"/v1/sandboxes/{sid}/commands", json={"cmd": cmd}).status_code == 201
            got = wait_for(lambda: (r := b.get(f"/v1/sandboxes/{sid}/ports/8000/hi.txt")).status_code == 200 and r,
                           60, "http.server in the sandbox, through replica B")
            assert got.content == b"over mTLS\n"
            for i in range(2):
                url = deployment.api_url(i).replace("http://", "ws://") + f"/v1/sandboxes/{sid}/ports/{PORT}/ws"

                def greets(url: str = url) -> dict[str, Any] | None:
                    try:
                        with connect(url, additional_headers={"authorization": f"Bearer {deployment.admin_key}"},
                                     proxy=None, open_timeout=30) as ws:
                            first = json.loads(ws.recv(timeout=30))
                            ws.send(b"\x00" * 100_000)
                            assert ws.recv(timeout=30) == b"\x00" * 100_000
                            return first  # type: ignore[no-any-return]
                    except OSError:
                        return None

                seen = wait_for(greets, 60, f"a WebSocket through replica {i}")
                assert seen["target"] == "/ws" and seen["headers"]["host"] == [f"localhost:{PORT}"]
        finally:
            _delete(a, sid)


def test_a_stream_resumes_on_the_other_replica_without_gap_or_repeat(deployment: Cluster) -> None:
    with deployment.client(0) as a, deployment.client(1) as b:
        sid = create_sandbox(a)
        try:
            r = a.post(f"/v1/sandboxes/{sid}/commands",
                       json={"shell": "for i in $(seq 1 60); do echo line-$i; sleep 0.05; done"})
            assert r.status_code == 201, r.text
            cid = r.json()["id"]
            first: list[dict[str, Any]] = []
            # Replica A is SIGKILLed ten events into the stream it serves: the client sees the
            # connection drop, and resumes on replica B from the last event it got.
            with pytest.raises(httpx.TransportError), \
                    a.stream("GET", f"/v1/sandboxes/{sid}/commands/{cid}/events") as stream:
                ev: dict[str, Any] = {}
                for line in stream.iter_lines():
                    if line.startswith(":"):
                        continue
                    if not line:
                        if ev:
                            ev["data"] = json.loads(ev.get("data", "null"))
                            first.append(ev)
                            if len(first) == 10:
                                deployment.apis[0].kill()
                        ev = {}
                        continue
                    key, _, value = line.partition(":")
                    ev[key] = value[1:] if value.startswith(" ") else value
            assert len(first) >= 10
            last_id = int(first[-1]["id"])
            rest = read_events(b, sid, cid, headers={"last-event-id": str(last_id)})
            ids = [int(e["id"]) for e in first + rest if e.get("id")]
            assert ids == sorted(set(ids)), "an event repeated or came out of order"
            out = b"".join(base64.b64decode(e["data"]["data"]) for e in first + rest if e["event"] == "stdout")
            assert out.decode().split() == [f"line-{i}" for i in range(1, 61)]
            assert rest[-1]["event"] == "exit"
        finally:
            _delete(b, sid)
            if not deployment.apis[0].alive():
                deployment.start_api(replace=0)


def test_a_node_refuses_whoever_holds_no_control_plane_certificate_of_its_cluster(deployment: Cluster) -> None:
    node = deployment.nodes[0]
    with deployment.node_client(node) as nc:
        assert nc.get("/v1/node").status_code == 200  # the control plane's certificate works

    def refused(client: httpx.Client) -> bool:
        with client:
            try:
                client.get("/v1/node")
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                return True
        return False

    # A stolen bearer token (there is none to steal: the old node token scheme) and no certificate.
    no_cert = httpx.Client(base_url=node.url, timeout=10, headers={"authorization": "Bearer stolen"},
                           verify=_trusting(deployment))
    assert refused(no_cert)
    # A control-plane certificate of another cluster CA.
    assert refused(deployment.node_client(node, ca=ClusterCA.create()))
    # Another node's own certificate and key, presented as a client (a compromised node).
    other = deployment.nodes[1]
    tls = other.data_dir / "node" / "tls"
    stolen = ((tls / "node.crt").read_bytes(), (tls / "node.key").read_bytes())
    assert refused(deployment.node_client(node, cert=stolen))


def _trusting(c: Cluster) -> Any:
    import ssl

    ctx = ssl.create_default_context(cadata=c.cluster_ca().cert_pem.decode())
    return ctx


def test_fifty_concurrent_creates_across_replicas_exist_once_and_the_quota_holds(deployment: Cluster) -> None:
    """50 creates at once, alternating between the replicas, by a tenant allowed 40 sandboxes:
    exactly 40 run, each once and on one node; the other 10 are refused with 429."""
    n, limit = 50, 40
    with deployment.client(0) as op:
        r = op.put("/v1/tenants/burst/quota", json={"sandboxes": limit, "cpu": None, "memory_mb": None,
                                                     "storage_mb": None, "disk_mb": None})
        assert r.status_code == 200, r.text
        r = op.post("/v1/apikeys", json={"tenant": "burst", "role": "admin", "name": "burst"})
        assert r.status_code == 201, r.text
        key = r.json()["key"]
    clients = [httpx.Client(base_url=deployment.api_url(i % 2), timeout=600,
                            headers={"authorization": f"Bearer {key}"}) for i in range(n)]

    def create(i: int) -> tuple[int, str | None]:
        r = clients[i].post("/v1/sandboxes", json={"template": "base", "memory_mb": 256})
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "quota_exceeded"
            return 429, None
        assert r.status_code == 202, r.text
        accepted.append(str(r.json()["sandbox"]["id"]))  # deleted at the end, whatever fails
        done = wait_operation(clients[i], r.json()["operation"]["id"], timeout=600)
        assert done["status"] == "succeeded", (done.get("error"), done)
        return 202, str(r.json()["sandbox"]["id"])

    accepted: list[str] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            results = list(pool.map(create, range(n)))
        made = [sid for _, sid in results if sid is not None]
        assert sorted(code for code, _ in results) == [202] * limit + [429] * (n - limit)
        assert len(set(made)) == limit
        listed = [s for s in clients[1].get("/v1/sandboxes").json()["sandboxes"] if s["state"] != "terminated"]
        assert sorted(s["id"] for s in listed) == sorted(made)
        assert all(s["state"] == "running" for s in listed)
        on_nodes = [sid for ids in node_sandboxes(deployment).values() for sid in ids if sid in made]
        assert sorted(on_nodes) == sorted(made), "a sandbox is missing on its node or exists twice"
    finally:
        for sid in accepted:
            _delete(clients[0], sid)
        for c in clients:
            c.close()


def _owner_pid(c: Cluster, owner: str) -> int:
    for p in c.controllers:
        if p.alive() and re.search(rf'"owner": "{re.escape(owner)}"', p.log_path.read_text(errors="replace")):
            return p.pid
    raise AssertionError(f"no live controller logged owner {owner}")


def test_a_controller_killed_mid_operation_is_replaced_and_the_operation_finishes_once(deployment: Cluster) -> None:
    """controller.create.after_node stalls the first controller to get there (both have it, as
    sleep-once): the node made the sandbox, the database does not say so yet. It is SIGKILLed; the
    other takes the lease over when it lapses and finishes the create: one sandbox, on one node."""
    c = deployment
    c.stall_marker.unlink()  # armed: the next controller to get there stalls
    with c.client(0) as api:
        r = api.post("/v1/sandboxes", json={"template": "base"})
        assert r.status_code == 202, r.text
        op_id, sid = r.json()["operation"]["id"], r.json()["sandbox"]["id"]
        try:
            def stalled() -> int | None:
                for p in c.controllers:
                    if p.alive() and "failpoint.sleep" in p.log_path.read_text(errors="replace"):
                        return p.pid
                return None

            wait_for(lambda: stalled() is not None, 120, "a controller to stall after the node created it")
            victim = next(p for p in c.controllers if p.pid == stalled())
            [(owner,)] = sql(c, "SELECT lease_owner FROM operations WHERE id = :id", id=op_id)
            assert _owner_pid(c, owner) == victim.pid
            victim.kill()
            op = wait_operation(api, op_id, timeout=120)
            assert op["status"] == "succeeded", op
            assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "running"
            placed = [node for node, ids in node_sandboxes(c).items() if sid in ids]
            assert len(placed) == 1, placed
            assert run(api, sid, {"shell": "echo alive"})[1] == b"alive\n"
            [(attempts, finisher)] = sql(c, "SELECT attempts, lease_owner FROM operations WHERE id = :id", id=op_id)
            assert finisher != owner and attempts >= 2
        finally:
            _delete(api, sid)
            c.start_controller()  # back to two, for what follows


def test_the_leader_is_replaced_when_it_dies(deployment: Cluster) -> None:
    c = deployment

    def live_leader() -> tuple[str, int] | None:
        rows = sql(c, "SELECT holder, fence FROM leases WHERE name = 'leader'")
        try:
            return (rows[0][0], rows[0][1]) if rows and _owner_pid(c, rows[0][0]) else None
        except AssertionError:  # still the one the test before killed, until its lease lapses
            return None

    holder, fence = wait_for(live_leader, 30, "a live controller to lead")
    leader = next(p for p in c.controllers if p.pid == _owner_pid(c, holder))
    t0 = time.monotonic()
    leader.kill()

    def new_leader() -> bool:
        rows = sql(c, "SELECT holder, fence FROM leases WHERE name = 'leader'")
        return bool(rows) and rows[0][0] != holder

    wait_for(new_leader, 30, "another controller to lead")
    took = time.monotonic() - t0
    [(now_holder, now_fence)] = sql(c, "SELECT holder, fence FROM leases WHERE name = 'leader'")
    assert now_fence > fence
    _owner_pid(c, now_holder)  # a live controller
    (c.work / "failover.json").write_text(json.dumps({"leader_failover_s": round(took, 3)}))
    c.start_controller()




def test_a_token_holder_advertising_another_nodes_address_gets_nothing_from_it(deployment: Cluster) -> None:
    """A join under a new id with node-b's address: the CA signs (it cannot know), but the control
    plane checks a node's certificate against the identity of the row it dials, so the handshake
    with node-b fails for that row: it never becomes ready, and node-b is never driven as it."""
    from space.cluster import pki

    c, victim = deployment, deployment.nodes[1]
    token = c.join_token(max_uses=1)
    body = {"node_id": "rogue", "advertise_url": victim.url, "csr": pki.make_key_and_csr("rogue")[1].decode()}
    with c.client(0) as api:
        r = httpx.post(f"{c.api_url(0)}/v1/nodes/join", json=body, headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 201, r.text
        try:
            def refused() -> bool:
                return any('"node": "rogue"' in line and "node.unreachable" in line and "CERTIFICATE" in line
                           for p in c.controllers if p.alive()
                           for line in p.log_path.read_text(errors="replace").splitlines())

            wait_for(refused, 60, "the leader's heartbeat to the rogue row to be refused in the handshake")
            assert api.get("/v1/nodes/rogue").json()["state"] == "joining"
        finally:
            assert api.delete("/v1/nodes/rogue").status_code == 204


def test_e2bs_own_sdk_works_through_either_replica(deployment: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The official SDK with its control calls on replica A and its envd traffic on replica B."""
    import e2b

    monkeypatch.setenv("E2B_API_URL", deployment.api_url(0))
    monkeypatch.setenv("E2B_SANDBOX_URL", deployment.api_url(1))
    monkeypatch.setenv("E2B_API_KEY", deployment.admin_key)
    for name in ("E2B_DEBUG", "E2B_DOMAIN", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    s = e2b.Sandbox.create()
    try:
        assert s.commands.run("echo hello from $(hostname)").stdout.startswith("hello from")
        s.files.write("/home/user/x.txt", "through B")
        assert s.files.read("/home/user/x.txt") == "through B"
        with deployment.client(0) as a:
            assert a.get(f"/v1/sandboxes/{s.sandbox_id}").json()["state"] == "running"
    finally:
        s.kill()


def _create_on(c: Cluster, a: httpx.Client, node_id: str) -> str:
    """A sandbox placed on ``node_id``: the other nodes cordoned while it is created."""
    others = [n.node_id for n in c.nodes if n.node_id != node_id]
    for other in others:
        a.post(f"/v1/nodes/{other}/cordon")
    try:
        return create_sandbox(a)
    finally:
        for other in others:
            a.post(f"/v1/nodes/{other}/uncordon")


def _controller_stalled_at(c: Cluster, failpoint: str) -> Proc | None:
    for p in c.controllers:
        if p.alive() and any('"failpoint.sleep"' in line and failpoint in line
                             for line in p.log_path.read_text(errors="replace").splitlines()):
            return p
    return None


def test_a_drain_moves_every_sandbox_with_its_processes_and_survives_a_controller_crash(
        deployment: Cluster) -> None:
    """Ten sandboxes on node-a (made while the other two are cordoned), nine counting in memory, one
    paused, one followed by the SDK over replica B. node-a is drained; the controller carrying the
    first move is SIGKILLed right after that move switched nodes (controller.move.after_switch). All
    ten end up elsewhere, exactly once, none on node-a; the counters count on from where they were,
    the paused one is still paused, the SDK's stream went on without a gap."""
    from space.sdk import Client

    c = deployment
    sids: list[str] = []
    cids: dict[str, str] = {}
    stop_at = [10**9]
    with c.client(0) as a, c.client(1) as b:
        try:
            for other in ("node-b", "node-c"):
                # Through the replica that creates: another replica's placement sees a cordon
                # within its node rows' cache (1 s), this one's at once.
                r = a.post(f"/v1/nodes/{other}/cordon")
                assert r.status_code == 200 and r.json()["cordoned"] and not r.json()["schedulable"], r.text
            try:
                for _ in range(10):
                    sids.append(create_sandbox(a, memory_mb=256))
            finally:
                for other in ("node-b", "node-c"):
                    assert not b.post(f"/v1/nodes/{other}/uncordon").json()["cordoned"]
            assert {a.get(f"/v1/sandboxes/{sid}").json()["node_id"] for sid in sids} == {"node-a"}
            assert set(sids) <= set(node_sandboxes(c)["node-a"])
            for sid in sids:
                r = a.post(f"/v1/sandboxes/{sid}/commands", json={"shell": LOUD_COUNTER})
                assert r.status_code == 201, r.text
                cids[sid] = r.json()["id"]
            before = {sid: counter_numbers(a, sid, cids[sid], 3)[-1] for sid in sids}
            paused = sids[-1]
            assert wait_operation(a, a.post(f"/v1/sandboxes/{paused}/pause").json()["operation"]["id"])[
                "status"] == "succeeded"

            # The SDK follows sids[0]'s counter over replica B through the whole drain.
            followed: list[int] = []
            stop_at[0] = 10**9
            failure: list[BaseException] = []

            def follow() -> None:
                try:
                    with Client(c.api_url(1), c.admin_key) as sdk:
                        buf = b""
                        for ev in sdk.sandboxes.ref(sids[0]).get_command(cids[sids[0]]).events():
                            buf += ev.data
                            *done, buf = buf.split(b"\n")
                            followed.extend(int(x) for x in done if x)
                            if followed and followed[-1] >= stop_at[0]:
                                return
                except BaseException as exc:  # handed to the test's thread
                    failure.append(exc)

            # A daemon thread, not an executor: when an assertion below fails, leaving an executor
            # would wait for a stream that never ends, and turn the failure into a timeout.
            follower = threading.Thread(target=follow, name="sdk-follower", daemon=True)
            follower.start()
            c.move_stall_marker.unlink()  # armed: the first move to switch nodes stalls there
            r = a.post("/v1/nodes/node-a/drain", json={"parallel": 3})
            assert r.status_code == 202, r.text
            drain_id = r.json()["operation"]["id"]
            assert r.json()["node"]["cordoned"]
            victim = wait_for(lambda: _controller_stalled_at(c, "controller.move.after_switch"), 180,
                              "a controller to stall after switching a move to its new node")
            victim.kill()
            c.start_controller()  # back to two
            op = wait_operation(a, drain_id, timeout=600)
            assert op["status"] == "succeeded", op
            assert sorted(op["result"]["moved"]) == sorted(sids)
            assert op["progress"]["remaining"] == 0 and op["progress"]["failed"] == 0

            # Every sandbox exactly once, none on node-a, where its row says.
            placed = node_sandboxes(c)
            assert not set(sids) & set(placed["node-a"]), placed["node-a"]
            for sid in sids:
                holders = [n for n, ids in placed.items() if sid in ids]
                row = b.get(f"/v1/sandboxes/{sid}").json()
                assert holders == [row["node_id"]], (sid, holders, row["node_id"])
                assert row["state"] == ("paused" if sid == paused else "running"), row
                moved = [e for e in b.get(f"/v1/sandboxes/{sid}/events").json()["events"] if e["kind"] == "moved"]
                assert len(moved) == 1 and moved[0]["data"]["from_node"] == "node-a", moved
            node_a = a.get("/v1/nodes/node-a").json()
            assert node_a["cordoned"] and node_a["state"] == "ready"

            # The counters count on from where they were: their memory came along.
            for sid in sids[:-1]:
                got = counter_numbers(b, sid, cids[sid], before[sid] + 4)
                assert got == list(range(1, len(got) + 1)), (sid, got)
            assert b.get(f"/v1/sandboxes/{paused}").json()["state"] == "paused"
            assert wait_operation(b, b.post(f"/v1/sandboxes/{paused}/resume").json()["operation"]["id"])[
                "status"] == "succeeded"
            got = counter_numbers(b, paused, cids[paused], before[paused] + 2)
            assert got == list(range(1, len(got) + 1)), got

            stop_at[0] = counter_numbers(b, sids[0], cids[sids[0]], 1)[-1] + 2
            follower.join(timeout=120)
            assert not follower.is_alive(), "the SDK's stream did not reach the end counter"
            if failure:
                raise failure[0]
            assert followed == list(range(1, len(followed) + 1)) and followed[-1] >= stop_at[0], followed[-20:]
        finally:
            stop_at[0] = -1  # a follower still reading returns at its next line
            c.move_stall_marker.touch()
            for sid in sids:
                _delete(a, sid)
            a.post("/v1/nodes/node-a/uncordon")


def test_a_drain_with_nowhere_to_go_is_refused(deployment: Cluster) -> None:
    with deployment.client(0) as a:
        try:
            for other in ("node-b", "node-c"):
                a.post(f"/v1/nodes/{other}/cordon")
            r = a.post("/v1/nodes/node-a/drain")
            assert r.status_code == 409 and "no other ready, uncordoned node" in r.json()["error"]["message"], r.text
            assert not a.get("/v1/nodes/node-a").json()["cordoned"]
        finally:
            for other in ("node-b", "node-c"):
                a.post(f"/v1/nodes/{other}/uncordon")


def test_a_node_that_leaves_is_drained_while_its_leaving_waits(deployment: Cluster) -> None:
    """``space node leave`` (a node pod's preStop hook when Kubernetes removes the machine; here
    ``--when always``, as an operator retiring one) marks node-c as leaving; the leader drains it
    and the command returns once node-c holds nothing. The sandbox runs on elsewhere, its counter
    counting on from where it was. Withdrawn and uncordoned after, for the scenarios that follow."""
    c = deployment
    node = next(n for n in c.nodes if n.node_id == "node-c")
    with c.client(0) as a:
        sid = _create_on(c, a, "node-c")
        try:
            assert a.get(f"/v1/sandboxes/{sid}").json()["node_id"] == "node-c"
            cid = a.post(f"/v1/sandboxes/{sid}/commands", json={"shell": LOUD_COUNTER}).json()["id"]
            before = counter_numbers(a, sid, cid, 2)[-1]
            leave = subprocess.run([SPACE, "node", "leave", "--data-dir", str(node.data_dir), "--when", "always",
                                    "--timeout", "300"], capture_output=True, text=True, timeout=400)
            assert leave.returncode == 0 and "every sandbox moved away" in leave.stderr, leave.stderr
            sb = a.get(f"/v1/sandboxes/{sid}").json()
            assert sb["state"] == "running" and sb["node_id"] in ("node-a", "node-b"), sb
            assert a.get("/v1/nodes/node-c").json()["cordoned"]
            moved = [e for e in a.get(f"/v1/sandboxes/{sid}/events").json()["events"] if e["kind"] == "moved"]
            assert len(moved) == 1 and moved[0]["data"]["from_node"] == "node-c" and moved[0]["data"]["drain"], moved
            got = counter_numbers(a, sid, cid, before + 4)
            assert got == list(range(1, len(got) + 1)), got
        finally:
            subprocess.run([SPACE, "node", "leave", "--data-dir", str(node.data_dir), "--cancel"],
                           capture_output=True, timeout=60)
            a.post("/v1/nodes/node-c/uncordon")
            _delete(a, sid)


def test_a_node_agent_restarted_in_place_keeps_its_sandboxes_running(deployment: Cluster) -> None:
    """The fast rolling upgrade: node-b's agent is stopped and started again on the same data (a new
    version would be a new binary); its join token is used up by now, so it serves on the certificate
    of its last join. The sandbox on it never stopped: its counter counts on, its command is the same."""
    c = deployment
    node = next(n for n in c.nodes if n.node_id == "node-b")
    with c.client(0) as a, c.client(1) as b:
        sid = _create_on(c, a, "node-b")
        try:
            assert a.get(f"/v1/sandboxes/{sid}").json()["node_id"] == "node-b"
            cid = a.post(f"/v1/sandboxes/{sid}/commands", json={"shell": LOUD_COUNTER}).json()["id"]
            before = counter_numbers(a, sid, cid, 2)[-1]
            node.proc.stop()
            node.proc.start()

            def serving() -> bool:
                node.proc.check_alive()
                try:
                    with c.node_client(node) as nc:
                        return nc.get("/v1/node").status_code == 200
                except httpx.HTTPError:
                    return False

            wait_for(serving, 120, "node-b's new agent to serve", interval=0.2)
            assert '"node.join_skipped"' in node.proc.log_tail(100_000)  # its token is used up
            c.wait_nodes_ready()
            got = counter_numbers(b, sid, cid, before + 4)
            assert got == list(range(1, len(got) + 1)), got
            assert run(b, sid, {"shell": "echo still here"})[1] == b"still here\n"
        finally:
            _delete(a, sid)


def test_a_node_joins_over_https_to_a_replica_serving_the_cluster_cas_certificate(deployment: Cluster) -> None:
    """``space keys api-cert`` issues the API's HTTPS certificate from the cluster CA; a replica
    serving it (``--tls-cert-file``) is where node-d joins, checking it with ``--control-ca-file``
    (what a Kubernetes node pod does through the in-cluster Service). A client trusting only the
    system's CAs is refused; node-d is ready and listed. (Last: node-d stays, cordoned.)"""
    c = deployment
    issued = subprocess.run([SPACE, "keys", "api-cert", str(c.keys_dir), "--host", "localhost", "--host", "127.0.0.1"],
                            capture_output=True, text=True, timeout=60)
    assert issued.returncode == 0, issued.stderr
    ca_file = c.keys_dir / "cluster-ca.pem"
    port = free_port()
    tls = ["--tls-cert-file", str(c.keys_dir / "api.pem"), "--tls-key-file", str(c.keys_dir / "api.key")]
    api = Proc("api-tls", [*c._control_argv("api"), "--listen", f"127.0.0.1:{port}", *tls],
               c.work / "api-tls.log", c._control_env())
    api.start()
    trusting = ssl.create_default_context(cafile=str(ca_file))
    try:
        def ready() -> bool:
            api.check_alive()
            try:
                return httpx.get(f"https://localhost:{port}/readyz", verify=trusting, timeout=2).status_code == 200
            except httpx.ConnectError:
                return False

        wait_for(ready, 120, "the HTTPS replica to be ready", interval=0.2)
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"https://localhost:{port}/readyz", timeout=5)
        c.start_node("node-d", control_url=f"https://localhost:{port}", control_ca=ca_file)
        c.wait_nodes_ready()
        with c.client(0) as a:
            row = a.get("/v1/nodes/node-d").json()
            assert row["state"] == "ready", row
            assert a.post("/v1/nodes/node-d/cordon").status_code == 200  # out of the other scenarios' way
    finally:
        api.stop()
