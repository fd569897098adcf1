"""``space.privdrop`` and ``space.nodesup``: the drop to the service user and its refusals, what the
user is given before it, and the root supervisor of the node agent. Real users, real files, real
processes; the drop itself always happens in a child process, never in the test runner."""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from space import privdrop, serve_state
from space.config import ServeSettings
from space.privdrop import PrivilegeError, ServiceUser
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[1]
USER = os.environ.get("SPACE_USER", "space")

@pytest.fixture
def user() -> ServiceUser:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    try:
        found = privdrop.resolve_user(USER)
    except PrivilegeError:
        pytest.skip(f"no user {USER!r} (scripts/setup-system.sh creates it)")
    assert found is not None
    return found


@pytest.fixture
def scratch(tmp_path: Path, user: ServiceUser) -> Path:
    """A directory the service user can reach (pytest's own are private to root)."""
    for d in reversed(tmp_path.parents):
        if not d.stat().st_mode & 0o001:
            os.chmod(d, stat.S_IMODE(d.stat().st_mode) | 0o001)
    os.chmod(tmp_path, 0o711)
    return tmp_path


def as_user(code: str, user: ServiceUser, *, drop: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a child that first drops to ``user`` through ``drop_privileges``."""
    pre = "from space import logs, privdrop, serve_state\nlogs.configure('warning')\n"  # logs go to stderr
    if drop:
        pre += f"privdrop.drop_privileges(privdrop.resolve_user({user.name!r}))\n"
    return subprocess.run([sys.executable, "-c", pre + textwrap.dedent(code)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)


# ---- resolve and drop --------------------------------------------------------------------------


def test_a_missing_user_is_refused_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PrivilegeError) as e:
        privdrop.resolve_user("space-no-such-user")
    assert "does not exist" in e.value.message and "--user root" in e.value.message

    def missing(name: str) -> pwd.struct_passwd:
        raise KeyError(name)

    monkeypatch.setattr(pwd, "getpwnam", missing)
    with pytest.raises(PrivilegeError) as e:
        privdrop.resolve_user("space")
    assert privdrop.CREATE_USER in e.value.message and "setup-system.sh" in e.value.message


def test_root_means_no_drop() -> None:
    assert privdrop.resolve_user("root") is None


def test_the_drop_is_refused_when_not_started_as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    # Checked before any id changes: nothing to undo in this process.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PrivilegeError, match="must start as root"):
        privdrop.drop_privileges(ServiceUser("space", 999, 999, "/"))


def test_the_drop_sets_every_id_and_leaves_no_way_back(user: ServiceUser) -> None:
    res = as_user("""
        import os
        from pathlib import Path
        print(os.getresuid(), os.getresgid(), os.getgroups())
        status = dict(l.split(":", 1) for l in Path("/proc/self/status").read_text().splitlines())
        print(status["CapEff"].strip(), status["NoNewPrivs"].strip(), os.environ["HOME"])
        for regain in (lambda: os.setuid(0), lambda: os.setgid(0), lambda: os.setgroups([0])):
            try:
                regain()
                print("regained")
            except PermissionError:
                pass
    """, user)
    assert res.returncode == 0, res.stderr
    ids, caps = res.stdout.splitlines()[:2]
    u, g = user.uid, user.gid
    assert ids == f"({u}, {u}, {u}) ({g}, {g}, {g}) []"
    assert caps.split()[:2] == ["0000000000000000", "1"]
    assert "regained" not in res.stdout


def test_a_drop_that_could_regain_root_is_refused(user: ServiceUser) -> None:
    """If setuid(0) still worked after the switch (here: the switch is faked), it must not serve."""
    res = as_user(f"""
        import os
        from space import privdrop
        u = privdrop.resolve_user({user.name!r})
        for name in ("setgroups", "setresgid", "setresuid", "setuid", "setgid"):
            setattr(os, name, lambda *a: None)
        os.getresuid = lambda: (u.uid,) * 3
        os.getresgid = lambda: (u.gid,) * 3
        os.getgroups = lambda: []
        try:
            privdrop.drop_privileges(u)
        except privdrop.PrivilegeError as e:
            print("refused:", e.message)
    """, user, drop=False)
    assert res.returncode == 0, res.stderr
    assert "refused: setuid(0) succeeded" in res.stdout


def test_state_the_user_cannot_reach_is_refused_naming_the_blocking_directory(
        scratch: Path, user: ServiceUser) -> None:
    os.chmod(scratch, 0o700)
    data = scratch / "data"
    res = as_user(f"""
        from pathlib import Path
        from space.config import ServeSettings
        try:
            serve_state.check_access(privdrop.resolve_user({user.name!r}), ServeSettings(data_dir=Path({str(data)!r})))
        except privdrop.PrivilegeError as e:
            print(e.details["blocker"])
    """, user)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(scratch)


# ---- what the user is given --------------------------------------------------------------------


def test_own_serve_state_hands_over_the_api_files_only(scratch: Path, user: ServiceUser) -> None:
    data = scratch / "data"
    data.mkdir(mode=0o700)
    (data / "secret.key").write_text("s\n")
    (data / "node.token").write_text("t\n")
    (data / "pool.lock").write_text("")
    settings = ServeSettings(data_dir=data)
    serve_state.migrate_layout(settings)
    serve_state.own_serve_state(settings, user)
    st = data.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, user.gid, 0o710)
    for name in ("secret.key", "master.key", "admin.key"):
        f = (data / name).stat()
        assert (f.st_uid, stat.S_IMODE(f.st_mode)) == (user.uid, 0o600), name
    assert (data / "admin.key").read_text() == ""  # for the API to fill
    assert (data / "master.key").read_text().strip()
    assert (data / "node.token").stat().st_uid == 0 and (data / "pool.lock").stat().st_uid == 0
    assert (data / "control").stat().st_uid == user.uid
    # The user reaches its state, and cannot create anything beside the node's.
    res = as_user(f"""
        from pathlib import Path
        from space.config import ServeSettings
        data = Path({str(data)!r})
        serve_state.check_access(privdrop.resolve_user({user.name!r}), ServeSettings(data_dir=data))
        (data / "control" / "space.db").write_text("db")
        (data / "admin.key").write_text("k")
        try:
            (data / "planted").write_text("x")
        except PermissionError:
            print("refused")
    """, user)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "refused"


def test_planted_links_in_the_users_directory_are_not_followed(scratch: Path, user: ServiceUser) -> None:
    data = scratch / "data"
    (data / "control").mkdir(parents=True)
    victim = scratch / "root-file"
    victim.write_text("root's")
    os.link(victim, data / "control" / "space.db-wal")  # a second name for a root file
    (data / "control" / "space.db-shm").symlink_to(victim)
    serve_state.own_serve_state(ServeSettings(data_dir=data), user)
    assert victim.stat().st_uid == 0


def test_an_old_layout_moves_into_the_control_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("space.db", "space.db-wal", "warm-pool.seeded"):
        (data / name).write_text(name)
    settings = ServeSettings(data_dir=data)
    serve_state.migrate_layout(settings)
    assert sorted(p.name for p in (data / "control").iterdir()) == ["space.db", "space.db-wal", "warm-pool.seeded"]
    assert (data / "control" / "space.db").read_text() == "space.db"
    assert not (data / "space.db").exists()
    assert settings.resolved_database_url().endswith("/data/control/space.db")
    serve_state.migrate_layout(settings)  # nothing left to do
    (data / "space.db").write_text("another")
    with pytest.raises(PrivilegeError, match="both"):
        serve_state.migrate_layout(settings)


def test_the_object_store_is_shared_with_the_users_group_now_and_later(scratch: Path, user: ServiceUser) -> None:
    objects = scratch / "objects"
    (objects / "old" / "deep").mkdir(parents=True)
    (objects / "old" / "deep" / "blob").write_bytes(b"x")
    serve_state.share_tree(objects, user.gid)
    # Made by root after the share, with root's umask: the default ACL still admits the group.
    (objects / "new" / "dir").mkdir(parents=True)
    (objects / "new" / "dir" / "blob").write_bytes(b"y")
    assert stat.S_IMODE(objects.stat().st_mode) & 0o007 == 0
    res = as_user(f"""
        from pathlib import Path
        o = Path({str(objects)!r})
        for d in ("old/deep", "new/dir"):
            (o / d / "blob").unlink()          # root's file, in root's directory
            (o / d / "mine").write_bytes(b"z")
            (o / d / "mine").unlink()
            (o / d).rmdir()
        print("ok")
    """, user)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
    serve_state.share_tree(objects, user.gid)  # done before: not walked again


# ---- the node agent's supervisor ---------------------------------------------------------------


@pytest.fixture
def supervised(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A supervisor running a stand-in node agent that appends its pid to a file and waits."""
    pids = tmp_path / "pids"
    child = [sys.executable, "-c",
             f"import os, signal\nopen({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\nsignal.pause()"]
    proc = subprocess.Popen([sys.executable, "-m", "space.nodesup"], stdin=subprocess.PIPE, cwd=REPO,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(child).encode() + b"\n")
    proc.stdin.flush()
    try:
        yield proc, pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _pids(pids):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _pids(f: Path) -> list[int]:
    return [int(x) for x in f.read_text().split()] if f.exists() else []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_the_supervisor_restarts_a_ready_node_and_stops_it_at_eof(
        supervised: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, pids = supervised
    assert proc.stdin is not None
    proc.stdin.write(b"ready\n")  # read with the node's exit at the latest
    proc.stdin.flush()
    first = wait_for(lambda: _pids(pids), 30, "the node to start")[0]
    os.kill(first, signal.SIGKILL)
    second = wait_for(lambda: _pids(pids)[1:], 30, "a new node")[0]
    assert second != first and _alive(second)
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    wait_for(lambda: not _alive(second), 30, "the node to stop with its supervisor")


def test_a_node_that_dies_before_it_was_ready_ends_the_supervisor(
        supervised: tuple[subprocess.Popen[bytes], Path]) -> None:
    proc, pids = supervised
    first = wait_for(lambda: _pids(pids), 30, "the node to start")[0]
    os.kill(first, signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert _pids(pids) == [first]
