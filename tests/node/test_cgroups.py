"""Where an instance's cgroup files are, per cgroup version (space.runtime.cgroups), and everything
that goes through it: the runtime driver, the stats, the root helper's removal and delegation.

- detection: v2 (unified; also as a container's cgroup namespace root), v1, hybrid (v1 controllers
  beside a ``unified/`` v2 tree) counts as v1; a host SPACE cannot run on is refused with a message
  naming what is missing and what to do: no hierarchy at all, a v1 controller not mounted, v2
  controllers not available (bound to v1), not enabled by a group that holds processes, no v2
  freezer (kernel < 5.2)
- files and values on fake trees: freezing (v1 ``freezer.state`` FROZEN/THAWED, v2
  ``cgroup.freeze`` 1/0; "frozen" is what was asked, "fully frozen" what the kernel finished), the
  CPU weight (v1 shares as they are, v2 ``cpu.weight`` through runc's and runsc's map: 2 -> 1,
  1024 -> 39, 262144 -> 10000), OOM kills, usage readings, the files the agent is given, the
  directories a removal rmdirs, whether processes remain
- the driver, the stats, and the helper's removal and delegation use the object they are given
- for real, on a cgroup2 filesystem mounted here: a process frozen and thawed through CgroupsV2,
  the cgroup kept while it lives and removed once it is gone, and detection refusing the mount
  (its controllers are bound to v1 on this host)

Not exercised for real: this host runs cgroup v1, and a cgroup2 mount here offers no controller
(cpu, memory, ... are bound to the v1 hierarchies), so ``cpu.weight``, ``memory.events``,
``memory.current``/``memory.max``/``memory.stat`` and ``cpu.stat``'s usage are read and written only
on fake trees. (The v1 side runs for real in tests/node/test_shim_fencing.py and the e2e tests.)
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from space import errors
from space.node.helper import verbs_runtime
from space.node.helper.verbs import HelperContext
from space.node.sandboxes import stats
from space.runtime import cgroups
from space.runtime.cgroups import CgroupsV1, CgroupsV2, Usage, detect, shares_to_weight
from space.runtime.gvisor import GVisorDriver
from tests.node.cgroupkit import cgroup2_root, instance_name, sleeper_in_v2
from tests.waiting import wait_for

I = "s1-abcde"  # noqa: E741 -- the instance of every fake tree
ALL_V2 = "cpuset cpu io memory hugetlb pids rdma misc"


def touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def fake_v1(root: Path, *, controllers: tuple[str, ...] = ("cpu", "cpuacct", "freezer", "memory", "pids")) -> Path:
    for c in controllers:
        touch(root / c / "cgroup.procs")
    return root


def fake_v2(root: Path, *, controllers: str = ALL_V2, enabled: str = ALL_V2, freezer: bool = True,
            groups: tuple[str, ...] = ("init.scope", "system.slice")) -> Path:
    touch(root / "cgroup.controllers", controllers + "\n")
    touch(root / "cgroup.subtree_control", enabled + "\n")
    touch(root / "cgroup.procs", "1\n")
    for g in groups:
        touch(root / g / "cgroup.procs")
        touch(root / g / "cgroup.type", "domain\n")
        if freezer:
            touch(root / g / "cgroup.freeze", "0\n")
    return root


def unsupported(root: Path) -> errors.CgroupsUnsupported:
    with pytest.raises(errors.CgroupsUnsupported) as info:
        detect(root)
    return info.value


# -- detection -------------------------------------------------------------------------------------


def test_v1_v2_and_hybrid_hosts_are_detected(tmp_path: Path) -> None:
    v1 = detect(fake_v1(tmp_path / "v1"))
    assert type(v1) is CgroupsV1 and v1.version == 1 and v1.root == tmp_path / "v1"
    v2 = detect(fake_v2(tmp_path / "v2"))
    assert type(v2) is CgroupsV2 and v2.version == 2 and v2.root == tmp_path / "v2"
    # Hybrid: the v1 controllers beside a v2 tree at unified/ (which holds no controller): v1, as runsc.
    hybrid = fake_v1(tmp_path / "hybrid")
    fake_v2(hybrid / "unified", controllers="", enabled="")
    assert type(detect(hybrid)) is CgroupsV1


def test_v2_as_a_containers_cgroup_namespace_root(tmp_path: Path) -> None:
    """A pod's view: the root is itself a group (it has cgroup.type and cgroup.freeze) holding the
    agent; it is fine as long as it enables the controllers for its children already."""
    root = fake_v2(tmp_path / "pod", groups=())
    touch(root / "cgroup.type", "domain\n")
    touch(root / "cgroup.freeze", "0\n")
    assert type(detect(root)) is CgroupsV2
    touch(root / "cgroup.subtree_control", "")  # runsc would have to enable them, which v2 refuses here
    err = unsupported(root)
    assert "cpu, cpuset, io, memory, pids" in err.message and "cgroup namespace" in err.message
    assert err.details["missing"] == ["cpu", "cpuset", "io", "memory", "pids"]
    (root / "cgroup.procs").write_text("")  # no process of its own: runsc enables them itself
    assert type(detect(root)) is CgroupsV2


def test_a_host_without_cgroups_is_refused(tmp_path: Path) -> None:
    err = unsupported(tmp_path)
    assert isinstance(err, errors.RuntimeFailure) and err.code == "cgroups_unsupported"
    assert f"no cgroup hierarchy at {tmp_path}" in err.message and "cgroup2" in err.message


def test_v1_without_the_freezer_is_refused_naming_it(tmp_path: Path) -> None:
    root = fake_v1(tmp_path, controllers=("cpu", "cpuacct", "memory"))
    (root / "freezer").mkdir()  # a directory, but nothing mounted on it
    err = unsupported(root)
    assert err.details == {"root": str(root), "version": 1, "missing": ["freezer"]}
    assert "lacks the freezer controller" in err.message
    assert "mount -t cgroup -o <controller>" in err.message and "systemd.unified_cgroup_hierarchy=1" in err.message


def test_v2_without_its_controllers_is_refused_naming_them(tmp_path: Path) -> None:
    """As on a host where they are bound to v1 hierarchies (this one)."""
    err = unsupported(fake_v2(tmp_path, controllers="hugetlb", enabled=""))
    assert err.details["missing"] == ["cpu", "cpuset", "io", "memory", "pids"]
    assert "does not offer the cpu, cpuset, io, memory, pids controller(s)" in err.message
    assert "(its cgroup.controllers: hugetlb)" in err.message and "cgroup_no_v1=all" in err.message
    err = unsupported(fake_v2(tmp_path / "nomem", controllers="cpuset cpu io pids"))
    assert err.details["missing"] == ["memory"]


def test_v2_without_the_freezer_is_refused(tmp_path: Path) -> None:
    err = unsupported(fake_v2(tmp_path, freezer=False))
    assert err.details["missing"] == ["cgroup.freeze"]
    assert "Linux 5.2 or newer" in err.message and os.uname().release in err.message


def test_v2_with_no_group_to_look_at_asks_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_v2(tmp_path, groups=())
    monkeypatch.setattr(cgroups, "_kernel", lambda: (5, 2))
    assert type(detect(root)) is CgroupsV2
    monkeypatch.setattr(cgroups, "_kernel", lambda: (4, 19))
    assert "no freezer" in unsupported(root).message


def test_this_host_is_detected_once() -> None:
    if not (cgroups.ROOT / "freezer" / "cgroup.procs").exists() or (cgroups.ROOT / "cgroup.controllers").exists():
        pytest.skip("this test knows the cgroup v1 host SPACE is built on")
    assert cgroups.host() is cgroups.host()
    assert cgroups.host() == CgroupsV1(cgroups.ROOT)


# -- files and values ------------------------------------------------------------------------------


def test_freezing_files_and_values(tmp_path: Path) -> None:
    v1, v2 = CgroupsV1(tmp_path / "v1"), CgroupsV2(tmp_path / "v2")
    assert v1.freeze_file(I) == tmp_path / "v1" / "freezer" / "space" / I / "freezer.state"
    assert v2.freeze_file(I) == tmp_path / "v2" / "space" / I / "cgroup.freeze"
    assert (v1.freeze_value(True), v1.freeze_value(False)) == ("FROZEN", "THAWED")
    assert (v2.freeze_value(True), v2.freeze_value(False)) == ("1", "0")
    for cg in (v1, v2):
        assert not cg.is_frozen(I) and not cg.fully_frozen(I)  # no cgroup: not frozen
        with pytest.raises(FileNotFoundError):
            cg.freeze(I)  # the instance is gone: the caller decides (the driver ignores it)

    touch(v1.freeze_file(I), "THAWED\n")
    v1.freeze(I)
    assert v1.freeze_file(I).read_text() == "FROZEN"
    v1.freeze_file(I).write_text("FREEZING\n")  # what the kernel shows until every task stopped
    assert v1.is_frozen(I) and not v1.fully_frozen(I)
    v1.freeze_file(I).write_text("FROZEN\n")
    assert v1.is_frozen(I) and v1.fully_frozen(I)
    v1.thaw(I)
    assert v1.freeze_file(I).read_text() == "THAWED" and not v1.is_frozen(I)

    touch(v2.freeze_file(I), "0\n")
    events = touch(v2.group(I) / "cgroup.events", "populated 1\nfrozen 0\n")
    v2.freeze(I)
    assert v2.freeze_file(I).read_text() == "1"
    # v2 freezes asynchronously: asked but not finished is frozen for whoever wants an answer.
    assert v2.is_frozen(I) and not v2.fully_frozen(I)
    events.write_text("populated 1\nfrozen 1\n")
    assert v2.fully_frozen(I)
    v2.thaw(I)
    assert v2.freeze_file(I).read_text() == "0" and not v2.is_frozen(I)


@pytest.mark.parametrize(("shares", "weight"), [(2, 1), (3, 1), (1024, 39), (2048, 79), (262144, 10000),
                                                (0, 1), (1, 1), (1 << 20, 10000)])
def test_shares_become_the_weight_runc_and_runsc_give(shares: int, weight: int) -> None:
    assert shares_to_weight(shares) == weight


def test_the_cpu_weight_is_written_as_shares_on_v1_and_as_weight_on_v2(tmp_path: Path) -> None:
    v1, v2 = CgroupsV1(tmp_path / "v1"), CgroupsV2(tmp_path / "v2")
    touch(v1.cpu_weight_file(I))
    touch(v2.cpu_weight_file(I))
    assert v1.cpu_weight_file(I) == tmp_path / "v1" / "cpu" / "space" / I / "cpu.shares"
    assert v2.cpu_weight_file(I) == tmp_path / "v2" / "space" / I / "cpu.weight"
    v1.set_cpu_weight(I, 2)
    v2.set_cpu_weight(I, 2)
    assert (v1.cpu_weight_file(I).read_text(), v2.cpu_weight_file(I).read_text()) == ("2", "1")
    v1.set_cpu_weight(I, cgroups.DEFAULT_SHARES)
    v2.set_cpu_weight(I, cgroups.DEFAULT_SHARES)
    assert (v1.cpu_weight_file(I).read_text(), v2.cpu_weight_file(I).read_text()) == ("1024", "39")


def test_oom_kills_are_counted_from_oom_control_and_memory_events(tmp_path: Path) -> None:
    v1, v2 = CgroupsV1(tmp_path / "v1"), CgroupsV2(tmp_path / "v2")
    assert v1.oom_kills(I) == 0 and v2.oom_kills(I) == 0
    control = touch(tmp_path / "v1" / "memory" / "space" / I / "memory.oom_control",
                    "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    events = touch(tmp_path / "v2" / "space" / I / "memory.events",
                   "low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert v1.oom_kills(I) == 3 and v2.oom_kills(I) == 2
    control.write_text("oom_kill_disable 0\nunder_oom 0\n")  # a kernel before 4.13 does not count
    events.write_text("garbage\n")
    assert v1.oom_kills(I) == 0 and v2.oom_kills(I) == 0


def test_usage_is_read_from_each_versions_files(tmp_path: Path) -> None:
    v1, v2 = CgroupsV1(tmp_path / "v1"), CgroupsV2(tmp_path / "v2")
    assert v1.usage(I) == v2.usage(I) == Usage(None, None, None, None)  # no cgroup: nothing known
    touch(tmp_path / "v1" / "cpuacct" / "space" / I / "cpuacct.usage", "123456789\n")
    mem = tmp_path / "v1" / "memory" / "space" / I
    touch(mem / "memory.usage_in_bytes", "1048576\n")
    touch(mem / "memory.limit_in_bytes", "536870912\n")
    touch(mem / "memory.stat", "cache 4096\nrss 8192\ntotal_cache 65536\ntotal_rss 8192\n")
    assert v1.usage(I) == Usage(cpu_ns=123456789, memory_bytes=1 << 20, memory_limit=512 << 20, cache_bytes=65536)
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (mem / "memory.stat").write_text("cache 4096\nrss 8192\n")  # no hierarchy totals: the group's own
    assert v1.usage(I).memory_limit is None and v1.usage(I).cache_bytes == 4096

    group = tmp_path / "v2" / "space" / I
    touch(group / "cpu.stat", "usage_usec 2500\nuser_usec 2000\nsystem_usec 500\n")
    touch(group / "memory.current", "2097152\n")
    touch(group / "memory.max", "max\n")
    touch(group / "memory.stat", "anon 8192\nfile 32768\nkernel 4096\n")
    assert v2.usage(I) == Usage(cpu_ns=2_500_000, memory_bytes=2 << 20, memory_limit=None, cache_bytes=32768)
    (group / "memory.max").write_text("268435456\n")
    assert v2.usage(I).memory_limit == 256 << 20


def test_the_stats_read_through_the_object_given(tmp_path: Path) -> None:
    v2 = CgroupsV2(tmp_path)
    group = tmp_path / "space" / I
    touch(group / "cpu.stat", "usage_usec 1000\n")
    touch(group / "memory.current", "4096\n")
    touch(group / "memory.max", "max\n")
    touch(group / "memory.stat", "file 1024\n")
    got = asyncio.run(stats.sample(I, cpu_count=2, memory_mb=256, window=0.01, cgroups=v2))
    assert got["cpu_used_pct"] == 0.0  # no CPU time went by between the readings
    assert (got["mem_used"], got["mem_total"], got["mem_cache"]) == (4096, 256 << 20, 1024)
    (group / "memory.max").write_text("1048576\n")
    got = asyncio.run(stats.sample(I, cpu_count=2, memory_mb=256, window=0.01, cgroups=v2))
    assert got["mem_total"] == 1 << 20
    gone = asyncio.run(stats.sample("gone-00000", cpu_count=1, memory_mb=64, window=0.0, cgroups=v2))
    assert gone["cpu_used_pct"] is None and gone["mem_used"] is None and gone["mem_total"] == 64 << 20


def test_delegated_files_groups_to_remove_and_processes(tmp_path: Path) -> None:
    v1 = CgroupsV1(fake_v1(tmp_path / "v1"))
    touch(tmp_path / "v1" / "release_agent")  # a file in the root is no hierarchy
    v2 = CgroupsV2(tmp_path / "v2")
    assert v1.delegated_files(I) == [tmp_path / "v1" / "freezer" / "space" / I / "freezer.state",
                                     tmp_path / "v1" / "cpu" / "space" / I / "cpu.shares"]
    assert v2.delegated_files(I) == [tmp_path / "v2" / "space" / I / "cgroup.freeze",
                                     tmp_path / "v2" / "space" / I / "cpu.weight"]
    assert v1.instance_groups(I) == [tmp_path / "v1" / c / "space" / I
                                     for c in ("cpu", "cpuacct", "freezer", "memory", "pids")]
    assert v2.instance_groups(I) == [tmp_path / "v2" / "space" / I]
    assert CgroupsV1(tmp_path / "nothing").instance_groups(I) == []

    assert not v1.has_processes(I) and not v2.has_processes(I)
    procs = touch(tmp_path / "v1" / "freezer" / "space" / I / "cgroup.procs", "4242\n")
    events = touch(tmp_path / "v2" / "space" / I / "cgroup.events", "populated 1\nfrozen 1\n")
    assert v1.has_processes(I) and v2.has_processes(I)
    procs.write_text("")
    events.write_text("populated 0\nfrozen 0\n")
    assert not v1.has_processes(I) and not v2.has_processes(I)


# -- what goes through it --------------------------------------------------------------------------


def test_the_driver_freezes_weights_and_reads_ooms_through_its_object(tmp_path: Path) -> None:
    v2 = CgroupsV2(tmp_path / "cg")
    driver = GVisorDriver(None, tmp_path, cgroups=v2)  # type: ignore[arg-type]
    freeze = touch(v2.freeze_file(I), "0\n")
    weight = touch(v2.cpu_weight_file(I))
    driver.freeze(I)
    assert freeze.read_text() == "1" and driver._frozen(I)
    driver.thaw(I)
    assert freeze.read_text() == "0" and not driver._frozen(I)
    driver.set_cpu_shares(I, 2)
    assert weight.read_text() == "1"
    driver.set_cpu_shares(I, 1024)
    assert weight.read_text() == "39"
    driver.freeze("gone-00000")  # no cgroup: nothing to freeze, no error
    driver.set_cpu_shares("gone-00000", 2)  # logged, never raised: it is on a claim's hot path
    assert asyncio.run(driver.death_cause(I)) is None
    touch(v2.group(I) / "memory.events", "oom 1\noom_kill 1\n")
    assert asyncio.run(driver.death_cause(I)) == "oom"


def test_the_helper_removes_and_delegates_through_its_object(tmp_path: Path) -> None:
    v2 = CgroupsV2(tmp_path / "cg")
    ctx = HelperContext(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache", cgroups=v2, agent_uid=4242)
    r = verbs_runtime.Runsc(ctx)
    assert r.cgroups is v2
    empty, busy = v2.group("s1-empty"), v2.group(I)
    empty.mkdir(parents=True)
    touch(busy / "cgroup.procs", "1\n")  # rmdir fails here as on a cgroup with a task in it
    assert verbs_runtime._remove_cgroups(v2, ["s1-empty", I, "gone-00000"]) == [busy]
    assert not empty.exists() and busy.exists()

    if os.geteuid() != 0:
        pytest.skip("handing files to another uid needs root")
    files = [touch(f) for f in v2.delegated_files(I)]
    verbs_runtime._delegate_cgroup(ctx, v2, I)
    assert [f.stat().st_uid for f in files] == [4242, 4242]
    assert busy.stat().st_uid == 0  # the files alone, never the group: the agent can make no group
    verbs_runtime._delegate_cgroup(ctx, v2, "gone-00000")  # no cgroup: nothing to hand over


# -- for real, on a cgroup2 filesystem -------------------------------------------------------------


def test_a_real_v2_group_freezes_thaws_and_goes(tmp_path: Path) -> None:
    """A process in ``<root>/space/<instance>`` of a cgroup2 mount, frozen and thawed through
    CgroupsV2 (the freeze is asynchronous: asked at once, finished when cgroup.events says so), its
    group busy while it lives and removed (as the helper does) once it is gone."""
    with cgroup2_root(tmp_path) as root:
        cg, name = CgroupsV2(root), instance_name()
        group = cg.group(name)
        group.mkdir(parents=True)
        assert not cg.has_processes(name) and not cg.is_frozen(name)
        with sleeper_in_v2(group) as proc:
            assert cg.has_processes(name)
            cg.freeze(name)
            assert cg.is_frozen(name)
            wait_for(lambda: cg.fully_frozen(name), 10, "the v2 freeze to finish")
            assert "frozen 1" in (group / "cgroup.events").read_text().splitlines()
            assert proc.poll() is None and cg.has_processes(name)  # frozen, not gone
            cg.thaw(name)
            assert not cg.is_frozen(name)
            wait_for(lambda: not cg.fully_frozen(name), 10, "the v2 thaw")
            assert "frozen 0" in (group / "cgroup.events").read_text().splitlines()
            assert verbs_runtime._remove_cgroups(cg, [name]) == [group]  # a task is still in it
        assert not cg.has_processes(name)
        assert verbs_runtime._remove_cgroups(cg, [name]) == []
        assert not group.exists()


def test_detection_refuses_a_real_v2_tree_whose_controllers_v1_holds(tmp_path: Path) -> None:
    with cgroup2_root(tmp_path) as root:
        mount = root.parent
        available = (mount / "cgroup.controllers").read_text().split()
        lacking = [c for c in cgroups.V2_CONTROLLERS if c not in available]
        if not lacking:
            pytest.skip("this host's cgroup2 offers every controller sandboxes need")
        with pytest.raises(errors.CgroupsUnsupported) as info:
            detect(mount)
        assert info.value.details["missing"] == lacking and "does not offer" in info.value.message
