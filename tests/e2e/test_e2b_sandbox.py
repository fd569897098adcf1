"""The official E2B SDK's sandbox lifecycle against SPACE: create, info, list, timeout, pause,
connect, kill, fork, metrics — and that they are SPACE's own sandboxes.

Mirrors E2B's ``tests/{sync,async}/sandbox_*/test_{create,connect,kill,timeout,metrics,fork}.py`` and
``api_*/test_sbx_{info,kill,list}.py``.
"""

from __future__ import annotations

import datetime as dt
import uuid

import httpx
import pytest

from tests.e2e import e2b_env
from tests.e2e.harness import runtime_available
from tests.waiting import await_for, wait_for

pytestmark = [pytest.mark.runtime, pytest.mark.skipif(runtime_available() is not None,
                                                      reason=str(runtime_available()))]

e2b = pytest.importorskip("e2b")


def _create(made: e2b_env.Sandboxes, **kw: object) -> e2b.Sandbox:
    s = e2b.Sandbox.create(**kw)
    made.add(s.sandbox_id)
    return s


def test_create_info_and_same_sandbox_in_space(made: e2b_env.Sandboxes, api: httpx.Client) -> None:
    tag = uuid.uuid4().hex
    s = _create(made, metadata={"test_id": tag}, timeout=120)
    assert s.is_running()
    info = s.get_info()
    assert info.sandbox_id == s.sandbox_id
    assert info.template_id == "base"
    assert info.metadata == {"test_id": tag}
    assert info.state.value == "running"
    left = (info.end_at - dt.datetime.now(dt.UTC)).total_seconds()
    assert 60 < left <= 121
    # The very sandbox SPACE's own API shows, with the tenant's key.
    own = api.get(f"/v1/sandboxes/{s.sandbox_id}").json()
    assert own["state"] == "running" and own["metadata"] == {"test_id": tag}


def test_unknown_template_and_bad_key(made: e2b_env.Sandboxes, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(e2b.SandboxException) as info:
        e2b.Sandbox.create("no-such-template")
    assert "404" in str(info.value)
    monkeypatch.setenv("E2B_API_KEY", "sk_wrong")
    with pytest.raises(e2b.AuthenticationException):
        e2b.Sandbox.create()


def test_kill_and_after(made: e2b_env.Sandboxes) -> None:
    s = _create(made)
    assert s.kill() is True
    assert e2b.Sandbox.kill(s.sandbox_id) is False
    with pytest.raises(e2b.SandboxNotFoundException):
        e2b.Sandbox.get_info(s.sandbox_id)
    with pytest.raises(e2b.SandboxNotFoundException):
        e2b.Sandbox.connect(s.sandbox_id)
    assert s.sandbox_id not in [x.sandbox_id for x in e2b.Sandbox.list().next_items()]
    assert s.is_running() is False


def test_list_filters_order_and_pagination(made: e2b_env.Sandboxes) -> None:
    tag = uuid.uuid4().hex
    boxes = [_create(made, metadata={"list_tag": tag, "n": str(i)}) for i in range(3)]
    query = e2b.SandboxQuery(metadata={"list_tag": tag})
    pager = e2b.Sandbox.list(query=query, limit=2)
    first = pager.next_items()
    assert len(first) == 2 and pager.has_next
    rest = pager.next_items()
    assert len(rest) == 1 and not pager.has_next
    # Newest first by default.
    assert [x.sandbox_id for x in first + rest] == [b.sandbox_id for b in reversed(boxes)]
    one = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"list_tag": tag, "n": "1"})).next_items()
    assert [x.sandbox_id for x in one] == [boxes[1].sandbox_id]
    boxes[0].pause()
    paused = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"list_tag": tag},
                                                     state=[e2b.SandboxState.PAUSED])).next_items()
    assert [x.sandbox_id for x in paused] == [boxes[0].sandbox_id]
    running = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"list_tag": tag},
                                                      state=[e2b.SandboxState.RUNNING])).next_items()
    assert {x.sandbox_id for x in running} == {boxes[1].sandbox_id, boxes[2].sandbox_id}


def test_set_timeout_and_the_timeout_kills(made: e2b_env.Sandboxes) -> None:
    s = _create(made, timeout=300)
    s.set_timeout(1000)
    assert (s.get_info().end_at - dt.datetime.now(dt.UTC)).total_seconds() > 900
    s.set_timeout(2)  # may shorten

    def gone() -> bool:
        try:
            e2b.Sandbox.get_info(s.sandbox_id)
        except e2b.SandboxNotFoundException:
            return True
        return False

    wait_for(gone, timeout=60, what="the sandbox to be killed by its timeout")


def test_pause_connect_keeps_files_and_processes(made: e2b_env.Sandboxes) -> None:
    s = _create(made)
    s.files.write("/home/user/kept.txt", "still here")
    loop = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.2; done"
    counter = s.commands.run(loop, background=True, timeout=0)
    # The loop's first write must happen before the pause (a background command is started, not yet run);
    # it renames each value into place, so a pause between truncate and write never leaves the file empty.
    wait_for(lambda: s.files.exists("/tmp/count"), timeout=30, what="the counter's first write")
    assert s.pause() is True
    assert s.pause() is False  # already paused
    assert s.is_running() is False
    assert e2b.Sandbox.get_info(s.sandbox_id).state.value == "paused"
    with pytest.raises(e2b.SandboxException):
        s.commands.run("true")  # envd traffic to a paused sandbox: not found
    again = e2b.Sandbox.connect(s.sandbox_id, timeout=120)
    assert again.sandbox_id == s.sandbox_id
    assert again.files.read("/home/user/kept.txt") == "still here"
    assert counter.pid in [p.pid for p in again.commands.list()]
    before = int(again.files.read("/tmp/count"))
    wait_for(lambda: int(again.files.read("/tmp/count")) > before, timeout=30, what="the counter to go on")
    # Connecting to a running sandbox changes nothing but may extend its time.
    assert e2b.Sandbox.connect(s.sandbox_id).sandbox_id == s.sandbox_id


def test_auto_pause_on_timeout_and_auto_resume(made: e2b_env.Sandboxes) -> None:
    s = _create(made, timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    s.files.write("/home/user/a.txt", "before")

    def paused() -> bool:
        return bool(e2b.Sandbox.get_info(s.sandbox_id).state.value == "paused")

    wait_for(paused, timeout=60, what="the timeout to pause the sandbox")
    # auto_resume: traffic wakes it.
    assert s.files.read("/home/user/a.txt") == "before"
    assert e2b.Sandbox.get_info(s.sandbox_id).state.value == "running"


def test_fork(made: e2b_env.Sandboxes) -> None:
    s = _create(made)
    s.files.write("/home/user/f.txt", "from parent")
    forks = s.fork(count=2) if hasattr(s, "fork") else []
    for f in forks:
        made.add(f.sandbox_id)
    assert len(forks) == 2
    for f in forks:
        assert f.sandbox_id != s.sandbox_id
        assert f.files.read("/home/user/f.txt") == "from parent"
    forks[0].files.write("/home/user/f.txt", "changed")
    assert s.files.read("/home/user/f.txt") == "from parent"
    assert forks[1].files.read("/home/user/f.txt") == "from parent"


def test_metrics(made: e2b_env.Sandboxes) -> None:
    s = _create(made)
    m = s.get_metrics()
    assert len(m) == 1
    assert m[0].cpu_count >= 1
    assert 0 <= m[0].cpu_used_pct <= 100
    assert 0 < m[0].mem_used <= m[0].mem_total


async def test_async_lifecycle(made: e2b_env.Sandboxes) -> None:
    s = await e2b.AsyncSandbox.create(metadata={"async": "yes"})
    made.add(s.sandbox_id)
    assert await s.is_running()
    info = await s.get_info()
    assert info.metadata == {"async": "yes"}
    assert await s.pause() is True
    again = await e2b.AsyncSandbox.connect(s.sandbox_id)
    assert (await again.commands.run("echo back")).stdout == "back\n"
    await s.set_timeout(60)
    assert await s.kill() is True
    assert await e2b.AsyncSandbox.kill(s.sandbox_id) is False

    async def gone() -> bool:
        return not await s.is_running()

    await await_for(gone, timeout=30, what="the killed sandbox to stop answering")


def test_e2b_calls_are_audited(made: e2b_env.Sandboxes, api: httpx.Client) -> None:
    s = _create(made)
    s.commands.run("true")
    s.kill()

    def records() -> list[dict[str, object]]:
        got = api.get("/v1/audit", params={"target": s.sandbox_id, "limit": 1000}).json()["records"]
        return list(got)

    def complete() -> list[dict[str, object]]:
        recs = records()
        actions = {r["action"] for r in recs}
        return recs if {"sandbox.create", "sandbox.exec", "sandbox.delete"} <= actions else []

    recs = wait_for(complete, timeout=30, what="the audit records of the E2B calls")
    by_action = {str(r["action"]): r for r in recs}
    assert by_action["sandbox.create"]["result"] == "ok"
    assert by_action["sandbox.exec"]["actor"] == "e2b-envd-token"
    assert by_action["sandbox.delete"]["status"] == 204


def test_repeated_pause_resume_keeps_everything(made: e2b_env.Sandboxes) -> None:
    """E2B users report files missing after the second resume, a 500 on it, and commands lost from
    ``list()`` (E2B#884, #736, #1031): three rounds here, the same id, files and process each time."""
    s = _create(made)
    handle = s.commands.run("sleep 600", background=True, timeout=0)
    for round_ in range(3):
        s.files.write(f"/home/user/round{round_}.txt", str(round_))
        assert s.pause() is True
        again = e2b.Sandbox.connect(s.sandbox_id)
        assert again.sandbox_id == s.sandbox_id
        for i in range(round_ + 1):
            assert again.files.read(f"/home/user/round{i}.txt") == str(i)
        assert handle.pid in [p.pid for p in again.commands.list()]
    assert again.commands.kill(handle.pid) is True


def test_pause_cuts_open_streams_and_connect_picks_up(made: e2b_env.Sandboxes) -> None:
    s = _create(made)
    handle = s.commands.run("sleep 4; echo finished", background=True, timeout=0)
    assert s.pause() is True
    # As on E2B, a stream does not outlive the pause: the SDK raises rather than hang.
    with pytest.raises(e2b.SandboxException):
        handle.wait()
    again = e2b.Sandbox.connect(s.sandbox_id)
    result = again.commands.connect(handle.pid).wait()
    assert result.stdout == "finished\n"


def test_pause_without_memory_keeps_files_and_boots_afresh(made: e2b_env.Sandboxes) -> None:
    s = _create(made)
    s.files.write("/home/user/marker.txt", "persisted")
    boot = s.files.read("/proc/sys/kernel/random/boot_id").strip()
    assert s.pause(keep_memory=False) is True
    assert e2b.Sandbox.get_info(s.sandbox_id).state.value == "paused"
    again = s.connect()
    assert again.files.read("/home/user/marker.txt") == "persisted"
    assert again.files.read("/proc/sys/kernel/random/boot_id").strip() != boot


def test_auto_pause_files_only(made: e2b_env.Sandboxes) -> None:
    s = _create(made, timeout=3, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
    boot = s.files.read("/proc/sys/kernel/random/boot_id").strip()

    def paused() -> bool:
        return bool(e2b.Sandbox.get_info(s.sandbox_id).state.value == "paused")

    wait_for(paused, timeout=60, what="the timeout to pause the sandbox (files only)")
    again = s.connect()
    assert again.files.read("/proc/sys/kernel/random/boot_id").strip() != boot
