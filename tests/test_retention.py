"""Snapshot schedule and tiered retention (space.retention): properties and examples."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from space.errors import InvalidRequest
from space.retention import (
    DEFAULT_TIERS,
    SnapshotPolicy,
    SnapshotRef,
    Tier,
    due,
    parse_duration,
    prune,
)

T0 = datetime(2024, 1, 1, tzinfo=UTC)  # a UTC midnight, so day buckets start on it
MIN, HOUR, DAY = 60, 3600, 86400

PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def snap(i: int, seconds: float, kind: str = "disk", origin: str = "schedule") -> SnapshotRef:
    return SnapshotRef(id=f"s{i:05d}", created_at=at(seconds), kind=kind, origin=origin)


def survivors(snaps: Sequence[SnapshotRef], policy: SnapshotPolicy, now: datetime,
              pinned: frozenset[str] = frozenset()) -> list[SnapshotRef]:
    gone = set(prune(snaps, policy, now, pinned))
    return [s for s in snaps if s.id not in gone]


def ids(snaps: Sequence[SnapshotRef]) -> set[str]:
    return {s.id for s in snaps}


# ---- strategies ---------------------------------------------------------------------------------

UNITS = st.sampled_from([MIN, 5 * MIN, HOUR])


@st.composite
def any_tiers(draw: st.DrawFn) -> tuple[Tier, ...]:
    """Any valid tier list (not necessarily nested), on a minute grid so buckets collide often."""
    n = draw(st.integers(0, 4))
    withins = sorted(draw(st.sets(st.integers(1, 48 * 60), min_size=n, max_size=n)))
    tiers = []
    for w in withins:
        every = draw(st.one_of(st.just(0), st.integers(1, w)))
        tiers.append(Tier(within=w * MIN, every=every * MIN))
    return tuple(tiers)


@st.composite
def nested_tiers(draw: st.DrawFn) -> tuple[Tier, ...]:
    """Tiers for which retention promises full stability: keep-all tiers first, then each ``every`` a
    multiple of the previous one and no tier narrower than its ``every``."""
    tiers: list[Tier] = []
    within = 0
    for _ in range(draw(st.integers(0, 2))):
        within += draw(st.integers(1, 120)) * MIN
        tiers.append(Tier(within=within, every=0))
    every = draw(st.sampled_from([MIN, 2 * MIN, 5 * MIN, 15 * MIN]))
    for _ in range(draw(st.integers(0, 3))):
        within += every * draw(st.integers(1, 8)) + draw(st.integers(0, 3)) * MIN
        tiers.append(Tier(within=within, every=every))
        every *= draw(st.sampled_from([1, 2, 3, 4, 6]))
    return tuple(tiers)


@st.composite
def histories(draw: st.DrawFn, horizon: int = 3 * DAY) -> list[SnapshotRef]:
    """Snapshots of both kinds and several origins, some sharing a timestamp."""
    n = draw(st.integers(0, 60))
    unit = draw(UNITS)
    times = draw(st.lists(st.integers(0, horizon // unit), min_size=n, max_size=n))
    kinds = draw(st.lists(st.sampled_from(["disk", "full"]), min_size=n, max_size=n))
    origins = draw(st.lists(st.sampled_from(["schedule"] * 4 + ["manual", "suspend", "fork"]),
                            min_size=n, max_size=n))
    return [snap(i, t * unit, k, o) for i, (t, k, o) in enumerate(zip(times, kinds, origins, strict=True))]


def pinned_of(data: st.DataObject, snaps: Sequence[SnapshotRef]) -> frozenset[str]:
    return frozenset(data.draw(st.sets(st.sampled_from(sorted(ids(snaps))))) if snaps else set())


# ---- prune: properties ---------------------------------------------------------------------------


@PROPS
@given(st.data(), any_tiers(), histories())
def test_prune_is_idempotent(data: st.DataObject, tiers: tuple[Tier, ...], snaps: list[SnapshotRef]) -> None:
    policy = SnapshotPolicy(tiers=tiers)
    pinned = pinned_of(data, snaps)
    now = at(data.draw(st.integers(0, 4 * DAY)))
    kept = survivors(snaps, policy, now, pinned)
    assert prune(kept, policy, now, pinned) == []


@PROPS
@given(st.data(), any_tiers(), histories())
def test_prune_never_deletes_manual_pinned_or_newest(data: st.DataObject, tiers: tuple[Tier, ...],
                                                     snaps: list[SnapshotRef]) -> None:
    policy = SnapshotPolicy(tiers=tiers)
    pinned = pinned_of(data, snaps)
    now = at(data.draw(st.integers(0, 4 * DAY)))
    deleted = prune(snaps, policy, now, pinned)
    assert len(deleted) == len(set(deleted))
    by_id = {s.id: s for s in snaps}
    for sid in deleted:
        assert by_id[sid].origin == "schedule"
        assert sid not in pinned
    for kind in ("disk", "full"):
        scheduled = [s for s in snaps if s.kind == kind and s.origin == "schedule"]
        if scheduled:
            newest = max(scheduled, key=lambda s: (s.created_at, s.id))
            assert newest.id not in deleted
    # Deterministic: the input order does not matter.
    assert prune(list(reversed(snaps)), policy, now, pinned) == deleted


@PROPS
@given(st.data(), any_tiers(), histories())
def test_number_kept_is_bounded_by_the_tiers(data: st.DataObject, tiers: tuple[Tier, ...],
                                             snaps: list[SnapshotRef]) -> None:
    policy = SnapshotPolicy(tiers=tiers)
    pinned = pinned_of(data, snaps)
    latest = max((s.created_at for s in snaps), default=T0)
    now = latest + timedelta(seconds=data.draw(st.integers(0, 2 * DAY)))
    kept = survivors(snaps, policy, now, pinned)
    for kind in ("disk", "full"):
        scheduled = [s for s in snaps if s.kind == kind and s.origin == "schedule"]
        kept_here = [s for s in kept if s.kind == kind and s.origin == "schedule"]
        bound = 1 + len({s.id for s in scheduled} & pinned)  # the newest, and the pinned
        ages = [(now - s.created_at).total_seconds() for s in scheduled]
        lower = 0.0
        for i, t in enumerate(tiers):
            if t.every == 0:  # keeps all of its ages; the first tier includes age 0
                bound += sum(1 for a in ages if (lower < a or i == 0) and a <= t.within)
            else:  # at most one per epoch-aligned bucket overlapping its span
                bound += math.ceil((t.within - lower) / t.every) + 1
            lower = t.within
        assert len(kept_here) <= bound


def test_defaults_one_snapshot_a_minute_for_eight_days_keep_the_tier_grid() -> None:
    """Pruning after every snapshot, as the scheduler does, over 8 days."""
    policy = SnapshotPolicy()
    alive: list[SnapshotRef] = []
    end = 8 * DAY // MIN
    for m in range(end + 1):
        alive.append(snap(m, m * MIN))
        alive = survivors(alive, policy, at(m * MIN))
        assert len(alive) <= 60 + 24 + 7 + 3
    now = end * MIN
    expected = {now - k * MIN for k in range(61)}  # everything from the last hour
    expected |= {now - h * HOUR for h in range(2, 25)}  # then each hour's first, back to 24 h
    expected |= {now - d * DAY for d in range(2, 8)}  # then each day's first, back to 7 days
    assert {int((s.created_at - T0).total_seconds()) for s in alive} == expected
    # The same as pruning the whole history at once.
    everything = [snap(m, m * MIN) for m in range(end + 1)]
    assert ids(survivors(everything, policy, at(now))) == ids(alive)


@PROPS
@given(st.data(), nested_tiers(), histories(horizon=DAY))
def test_nested_tiers_prune_successively_as_from_scratch_and_never_revive(
        data: st.DataObject, tiers: tuple[Tier, ...], snaps: list[SnapshotRef]) -> None:
    policy = SnapshotPolicy(tiers=tiers)
    pinned = pinned_of(data, snaps)
    ticks = sorted(data.draw(st.lists(st.integers(0, 2 * DAY // MIN), min_size=1, max_size=8)))
    alive: list[SnapshotRef] = []
    prev_kept: set[str] | None = None
    prev_now: datetime | None = None
    for tick in ticks:
        now = at(tick * MIN)
        history = [s for s in snaps if s.created_at <= now]
        alive += [s for s in history if prev_now is None or s.created_at > prev_now]
        alive = survivors(alive, policy, now, pinned)
        from_scratch = ids(survivors(history, policy, now, pinned))
        assert ids(alive) == from_scratch
        if prev_kept is not None and prev_now is not None:
            # A snapshot that existed at the previous tick is kept now only if it was kept then.
            older = {s.id for s in history if s.created_at <= prev_now}
            assert from_scratch & older <= prev_kept
        prev_kept, prev_now = from_scratch, now


@PROPS
@given(st.data(), any_tiers(), histories(horizon=DAY))
def test_any_tiers_successive_pruning_only_ever_removes(
        data: st.DataObject, tiers: tuple[Tier, ...], snaps: list[SnapshotRef]) -> None:
    policy = SnapshotPolicy(tiers=tiers)
    pinned = pinned_of(data, snaps)
    ticks = sorted(data.draw(st.lists(st.integers(0, 2 * DAY // MIN), min_size=1, max_size=8)))
    alive: list[SnapshotRef] = []
    prev_now: datetime | None = None
    for tick in ticks:
        now = at(tick * MIN)
        new = [s for s in snaps if s.created_at <= now and (prev_now is None or s.created_at > prev_now)]
        before = ids(alive)
        alive = survivors(alive + new, policy, now, pinned)
        assert ids(alive) <= before | ids(new)
        assert prune(alive, policy, now, pinned) == []
        prev_now = now


# ---- prune: examples -----------------------------------------------------------------------------


def test_keeps_the_oldest_of_each_bucket_on_the_epoch_grid() -> None:
    policy = SnapshotPolicy(tiers=(Tier(within=10 * HOUR, every=HOUR),))
    now = at(10 * HOUR)
    snaps = [snap(i, t) for i, t in enumerate([HOUR + 10, HOUR + 20, HOUR + 3000, 2 * HOUR, 2 * HOUR + 1, 9 * HOUR])]
    assert prune(snaps, policy, now) == ["s00001", "s00002", "s00004"]


def test_a_bucket_whose_oldest_aged_into_a_coarser_tier_is_not_represented_again() -> None:
    """Hour 05:00 of day 1: its 05:00 snapshot crossed into the daily tier (and lost there to 00:00),
    its 05:30 one is still in the hourly tier. Pruned on every tick, 05:30 went when 05:00 was its
    hour's oldest; pruning the whole history at once must agree, not bring 05:30 back."""
    policy = SnapshotPolicy(tiers=(Tier(within=DAY, every=HOUR), Tier(within=7 * DAY, every=DAY)))
    day = DAY
    snaps = [snap(0, day), snap(1, day + 5 * HOUR), snap(2, day + 5 * HOUR + 30 * MIN), snap(3, 3 * DAY)]
    earlier = at(day + 5 * HOUR + DAY - MIN)
    assert prune(snaps, policy, earlier) == ["s00002"]
    later = at(day + 5 * HOUR + DAY + 10 * MIN)
    assert prune(snaps, policy, later) == ["s00001", "s00002"]
    assert prune([s for s in snaps if s.id != "s00002"], policy, later) == ["s00001"]


def test_kinds_have_separate_timelines() -> None:
    policy = SnapshotPolicy(tiers=(Tier(within=DAY, every=HOUR),))
    snaps = [snap(0, 10, "full"), snap(1, 20, "disk"), snap(2, 30, "disk"), snap(3, 40, "full"), snap(4, 2 * HOUR)]
    assert prune(snaps, policy, at(3 * HOUR)) == ["s00002"]


def test_too_old_are_deleted_but_the_newest_of_each_kind_and_non_scheduled_stay() -> None:
    policy = SnapshotPolicy()
    snaps = [snap(0, 0), snap(1, MIN), snap(2, 2 * MIN, origin="manual"), snap(3, 3 * MIN, "full"),
             snap(4, 4 * MIN, "full", origin="suspend"), snap(5, 5 * MIN, "full")]
    assert prune(snaps, policy, at(30 * DAY)) == ["s00000", "s00003"]
    assert prune(snaps, policy, at(30 * DAY), pinned={"s00000"}) == ["s00003"]


def test_empty_retention_keeps_only_the_newest_and_the_protected() -> None:
    policy = SnapshotPolicy(tiers=())
    snaps = [snap(i, i * MIN) for i in range(5)]
    assert prune(snaps, policy, at(5 * MIN), pinned={"s00002"}) == ["s00000", "s00001", "s00003"]


def test_a_pinned_newer_snapshot_does_not_displace_the_bucket_oldest() -> None:
    policy = SnapshotPolicy(tiers=(Tier(within=DAY, every=HOUR),))
    snaps = [snap(0, 60), snap(1, 120), snap(2, 180), snap(3, 5 * HOUR)]
    assert prune(snaps, policy, at(6 * HOUR), pinned={"s00001"}) == ["s00002"]


def test_future_snapshots_count_as_new_and_naive_datetimes_are_utc() -> None:
    policy = SnapshotPolicy(tiers=(Tier(within=HOUR, every=0),))
    future = SnapshotRef(id="f", created_at=at(2 * HOUR), kind="disk", origin="schedule")
    naive = SnapshotRef(id="n", created_at=at(HOUR + 30).replace(tzinfo=None), kind="disk", origin="schedule")
    old = snap(0, 0)
    assert prune([old, naive, future], policy, at(HOUR + 60)) == ["s00000"]


# ---- policy parsing --------------------------------------------------------------------------------


def test_from_dict_defaults_and_partial_overrides() -> None:
    assert SnapshotPolicy.from_dict(None) == SnapshotPolicy()
    assert SnapshotPolicy.from_dict({}) == SnapshotPolicy()
    assert SnapshotPolicy().tiers == DEFAULT_TIERS
    p = SnapshotPolicy.from_dict({"disk_every": "2m"})
    assert (p.disk_every, p.full_every, p.tiers) == (120, 900, DEFAULT_TIERS)


def test_from_dict_full_example_and_canonical_form() -> None:
    p = SnapshotPolicy.from_dict({
        "disk_every": 60, "full_every": 900,
        "retention": [{"within": "1h", "every": 0}, {"within": "24h", "every": "1h"}, {"within": "7d", "every": "1d"}],
    })
    assert p == SnapshotPolicy()
    assert p.to_dict() == {
        "disk_every": 60, "full_every": 900,
        "retention": [{"within": 3600, "every": 0}, {"within": 86400, "every": 3600},
                      {"within": 604800, "every": 86400}],
    }


@pytest.mark.parametrize("value", [None, 0, "0", "0s"])
def test_from_dict_null_or_zero_disables_a_schedule(value: Any) -> None:
    p = SnapshotPolicy.from_dict({"disk_every": value, "full_every": value})
    assert p.disk_every is None and p.full_every is None
    assert p.to_dict()["disk_every"] is None
    assert not due(p, "disk", None, T0) and not due(p, "full", None, T0)


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30), ("5m", 300), ("1h", 3600), ("7d", 604800), ("2w", 1209600), ("1h30m", 5400),
    ("90", 90), (" 1.5H ", 5400), (45, 45), (2.5, 2.5),
])
def test_parse_duration(text: Any, seconds: float) -> None:
    assert parse_duration(text, "x") == seconds


@pytest.mark.parametrize(("d", "bad_field"), [
    ({"disk_every": -5}, "disk_every"),
    ({"disk_every": 5}, "disk_every"),
    ({"disk_every": "9s"}, "disk_every"),
    ({"full_every": 30}, "full_every"),
    ({"full_every": "soon"}, "full_every"),
    ({"full_every": True}, "full_every"),
    ({"full_every": float("nan")}, "full_every"),
    ({"full_every": "1h 5"}, "full_every"),
    ({"disk_every": [60]}, "disk_every"),
    ({"disk_every": "100000d"}, "disk_every"),
    ({"keep": 3}, "keep"),
    ({"retention": "1h"}, "retention"),
    ({"retention": [3600]}, "retention[0]"),
    ({"retention": [{"within": "1h"}]}, "retention[0].every"),
    ({"retention": [{"every": 0}]}, "retention[0].within"),
    ({"retention": [{"within": "1h", "every": 0, "count": 3}]}, "retention[0].count"),
    ({"retention": [{"within": -1, "every": 0}]}, "retention[0].within"),
    ({"retention": [{"within": 0, "every": 0}]}, "retention[0].within"),
    ({"retention": [{"within": "1h", "every": "-1m"}]}, "retention[0].every"),
    ({"retention": [{"within": "1h", "every": "2h"}]}, "retention[0].every"),
    ({"retention": [{"within": "1d", "every": 0}, {"within": "1d", "every": "1h"}]}, "retention[1].within"),
    ({"retention": [{"within": "1d", "every": 0}, {"within": "1h", "every": "1h"}]}, "retention[1].within"),
    ({"retention": [{"within": f"{i + 1}h", "every": 0} for i in range(17)]}, "retention"),
])
def test_from_dict_rejects_with_the_field_named(d: dict[str, Any], bad_field: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        SnapshotPolicy.from_dict(d)
    assert exc.value.details["field"] == bad_field
    assert bad_field in exc.value.message


def test_from_dict_rejects_a_non_object() -> None:
    with pytest.raises(InvalidRequest):
        SnapshotPolicy.from_dict([("disk_every", 60)])  # type: ignore[arg-type]


def test_sixteen_tiers_are_fine() -> None:
    p = SnapshotPolicy.from_dict({"retention": [{"within": f"{i + 1}h", "every": 0} for i in range(16)]})
    assert len(p.tiers) == 16


def test_constructors_validate_too() -> None:
    with pytest.raises(InvalidRequest):
        Tier(within=60, every=120)
    with pytest.raises(InvalidRequest):
        SnapshotPolicy(disk_every=1)
    with pytest.raises(InvalidRequest):
        SnapshotPolicy(tiers=(Tier(within=DAY), Tier(within=HOUR)))


@PROPS
@given(any_tiers(), st.one_of(st.none(), st.integers(10, DAY)), st.one_of(st.none(), st.floats(60, DAY)))
def test_to_dict_round_trips(tiers: tuple[Tier, ...], disk: int | None, full: float | None) -> None:
    p = SnapshotPolicy(disk_every=disk, full_every=full, tiers=tiers)
    assert SnapshotPolicy.from_dict(p.to_dict()) == p


# ---- due ---------------------------------------------------------------------------------------------


def test_due() -> None:
    p = SnapshotPolicy(disk_every=60, full_every=900)
    assert due(p, "disk", None, T0)
    assert not due(p, "disk", T0, at(59.999))
    assert due(p, "disk", T0, at(60))
    assert not due(p, "full", T0, at(899))
    assert due(p, "full", T0, at(901))
    # A last snapshot slightly ahead of the clock waits; one far ahead means the clock stepped back.
    assert not due(p, "disk", at(30), T0)
    assert due(p, "disk", at(3600), T0)
    assert due(p, "disk", T0.replace(tzinfo=None), at(60))
    with pytest.raises(InvalidRequest):
        due(p, "memory", None, T0)


def test_backup_every_defers_to_the_deployment_unless_the_sandbox_says() -> None:
    from space.retention import SnapshotPolicy

    assert SnapshotPolicy.from_dict({}).backup_interval(60) == 60
    assert SnapshotPolicy.from_dict({}).backup_interval(None) is None
    assert SnapshotPolicy.from_dict({"backup_every": "2m"}).backup_interval(None) == 120
    assert SnapshotPolicy.from_dict({"backup_every": 0}).backup_interval(60) is None  # off for this one
    assert SnapshotPolicy.from_dict({"backup_every": None}).backup_interval(60) is None
    assert SnapshotPolicy.from_dict({"backup_every": 5}).to_dict()["backup_every"] == 5
    assert "backup_every" not in SnapshotPolicy.from_dict({}).to_dict()  # stored policies stay as they were
    with pytest.raises(InvalidRequest) as info:
        SnapshotPolicy.from_dict({"backup_every": 0.5})
    assert info.value.details.get("field") == "backup_every"
