"""Directory watchers through the node API on a real sandbox: gVisor delivers inotify events for changes
made inside it, and a watcher survives pause, a fork (a checkpoint, restored as a new sandbox) and a
suspend/restore."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from space.node.main import channel_dir_for
from tests.e2e.harness import Server, create_sandbox, run, wait_for, wait_operation

pytestmark = pytest.mark.runtime

Events = list[dict[str, Any]]


@pytest.fixture(scope="module")
def node(server: Server) -> Iterator[httpx.Client]:
    """The shared server's node agent, through its socket and token."""
    token = (server.data_dir / "node.token").read_text().strip()
    transport = httpx.HTTPTransport(uds=str(channel_dir_for(server.data_dir) / "node.sock"))
    with httpx.Client(transport=transport, base_url="http://node", timeout=60,
                      headers={"authorization": f"Bearer {token}"}) as c:
        yield c


def sh(api: httpx.Client, sid: str, script: str) -> None:
    code, out, err = run(api, sid, {"shell": script})
    assert code == 0, (code, out, err)


def act(api: httpx.Client, sid: str, action: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = api.post(f"/v1/sandboxes/{sid}/{action}", json=body)
    assert r.status_code == 202, r.text
    op = wait_operation(api, r.json()["operation"]["id"], timeout=300)
    assert op["status"] == "succeeded", op
    return op


def poll_until(node: httpx.Client, sid: str, wid: str, done: Callable[[Events], bool], what: str) -> Events:
    got: Events = []

    def step() -> bool:
        r = node.get(f"/v1/sandboxes/{sid}/watchers/{wid}/events")
        assert r.status_code == 200, r.text
        got.extend(r.json()["events"])
        return done(got)

    wait_for(step, 30, what, interval=0.1)
    return got


def has(name: str, kind: str) -> Callable[[Events], bool]:
    return lambda evs: any(e["name"] == name and e["type"] == kind for e in evs)


def test_watchers_on_a_real_sandbox(api: httpx.Client, node: httpx.Client) -> None:
    sid = create_sandbox(api)
    made = [sid]
    try:
        sh(api, sid, "mkdir -p /home/user/w/old")
        base = f"/v1/sandboxes/{sid}/watchers"
        r = node.post(base, json={"path": "/home/user/../user/w", "recursive": True})
        assert r.status_code == 201, r.text
        wid = r.json()["id"]

        sh(api, sid, "cd /home/user/w && echo hi > a && chmod 600 a && mv a b && mkdir -p n/x "
                     "&& echo deep > n/x/f && echo more >> old/g && rm b")
        events = poll_until(node, sid, wid, has("b", "remove"), "the removal of b")
        seen = [(e["type"], e["name"]) for e in events]
        for want in [("create", "a"), ("write", "a"), ("chmod", "a"), ("rename", "a"), ("create", "b"),
                     ("create", "n"), ("create", "n/x/f"), ("write", "old/g"), ("remove", "b")]:
            assert want in seen, (want, seen)
        assert seen.index(("create", "a")) < seen.index(("chmod", "a")) < seen.index(("remove", "b"))

        # Errors are the API's: unknown watcher, missing directory, a path that escapes.
        r = node.get(f"{base}/w-nope/events")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = node.post(base, json={"path": "/home/user/missing"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = node.post(base, json={"path": "/../etc"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_path"

        # Pause is a freeze: the watcher carries on after it.
        act(api, sid, "pause")
        act(api, sid, "resume")
        sh(api, sid, "touch /home/user/w/after-pause")
        poll_until(node, sid, wid, has("after-pause", "create"), "an event after the pause")

        # A fork restores a checkpoint taken with the watcher open: both sides keep watching, apart.
        op = act(api, sid, "fork", {"count": 1})
        fork = op["result"]["sandbox_ids"][0]
        made.append(fork)
        sh(api, fork, "touch /home/user/w/n/x/in-fork")
        sh(api, sid, "touch /home/user/w/in-source")
        forked = poll_until(node, fork, wid, has("n/x/in-fork", "create"), "an event in the fork")
        assert not has("in-source", "create")(forked)
        source = poll_until(node, sid, wid, has("in-source", "create"), "an event in the source")
        assert not has("n/x/in-fork", "create")(source)

        # Suspend (a checkpoint shipped to object storage) and restore.
        act(api, sid, "suspend")
        act(api, sid, "restore")
        sh(api, sid, "echo x > /home/user/w/n/after-restore")
        poll_until(node, sid, wid, has("n/after-restore", "write"), "an event after the restore")

        assert node.delete(f"{base}/{wid}").status_code == 204
        r = node.get(f"{base}/{wid}/events")
        assert r.status_code == 404, r.text
    finally:
        for s in made:
            api.delete(f"/v1/sandboxes/{s}")
