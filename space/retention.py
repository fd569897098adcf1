"""Snapshot schedule and tiered retention: pure decisions, no I/O.

A sandbox's :class:`SnapshotPolicy` says how often the scheduler takes *disk* snapshots and *full*
checkpoints (:func:`due`) and which *scheduled* snapshots to keep as they age (:func:`prune`).

Retention is a list of tiers ordered by age. A tier ``Tier(within=W, every=E)`` covers the ages
``(previous W, W]``; with ``E == 0`` it keeps every snapshot of those ages, otherwise one per
epoch-aligned bucket of ``E`` seconds: the bucket's *oldest* snapshot. Snapshots older than the
last tier go. "Oldest in the bucket" is taken over every scheduled snapshot of that kind still
present, whatever tier it sits in; that is what makes a decision a function of (snapshots, now)
alone, so pruning on each tick gives the same survivors as pruning the whole history once.

Buckets are aligned to the epoch, not to ``now``, so a bucket's representative does not change as
time passes. When each tier's ``every`` is a multiple of the previous non-zero one and no tier is
narrower than its own ``every`` (true of the defaults), a snapshot deleted once would never be
kept later, and a kept one stays kept while it is the oldest of each coarser bucket it ages into.
Other policies are accepted; they just lose that guarantee at some tier boundaries.

Never pruned: snapshots whose origin is not ``schedule`` (manual, suspend, fork, ...), pinned ones
(the caller decides: in use by a fork/restore, a suspended sandbox's state, the newest full
checkpoint crash recovery needs), and the newest scheduled snapshot of each kind. A pinned
snapshot still counts as its bucket's oldest, so it stands in for that bucket rather than adding
to it.

All arithmetic is on integer microseconds so bucket edges are exact and results deterministic.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from space.errors import InvalidRequest

KINDS = ("disk", "full")
ORIGIN_SCHEDULE = "schedule"

#: Floors that keep a user's policy from turning the scheduler into a snapshot storm.
MIN_DISK_EVERY = 10.0
MIN_FULL_EVERY = 60.0
#: Continuous disk backup (``backup_every``): how often the node looks for changes to ship.
MIN_BACKUP_EVERY = 1.0
MAX_TIERS = 16
#: Upper bound of any duration: keeps datetime arithmetic far from overflow and typos visible.
MAX_DURATION = 10 * 366 * 86400.0

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_US = timedelta(microseconds=1)
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_PLAIN_NUMBER = re.compile(r"\d+(?:\.\d+)?")


# ---- time ---------------------------------------------------------------------------------------


def _micros(t: datetime) -> int:
    # Naive datetimes are UTC throughout SPACE (the store writes UTC); never the host's local zone.
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return (t - _EPOCH) // _US


def _to_micros(seconds: float) -> int:
    return round(seconds * 1_000_000)


# ---- parsing and validation ---------------------------------------------------------------------


def _num(v: float | None) -> float | int | None:
    if v is None:
        return None
    return int(v) if float(v).is_integer() else float(v)


def parse_duration(value: Any, name: str) -> float:
    """Seconds from a number or a string like ``"90"``, ``"30s"``, ``"5m"``, ``"1h30m"``, ``"7d"``."""
    if isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a duration, not a boolean", field=name)
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _parse_duration_str(value.strip().lower(), name)
    else:
        raise InvalidRequest(f"{name} must be a number of seconds or a string like '5m'", field=name)
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidRequest(f"{name} must be a non-negative finite duration, got {value!r}", field=name)
    if seconds > MAX_DURATION:
        raise InvalidRequest(f"{name} is longer than 10 years: {value!r}", field=name)
    return seconds


def parse_backup_every(value: Any, name: str = "every") -> float | None:
    """A backup interval set for a tenant: seconds (at least :data:`MIN_BACKUP_EVERY`), ``0`` or
    ``"off"`` for no backup (0.0), ``None`` or ``"default"`` for the deployment's default (None)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "default"):
        return None
    if isinstance(value, str) and value.strip().lower() == "off":
        return 0.0
    seconds = parse_duration(value, name)
    if 0 < seconds < MIN_BACKUP_EVERY:
        raise InvalidRequest(f"{name} must be at least {_num(MIN_BACKUP_EVERY)}s, 0 or 'off' (no backup), or null or "
                             f"'default' (the deployment's), got {_num(seconds)}", field=name)
    return seconds


def _parse_duration_str(text: str, name: str) -> float:
    if _PLAIN_NUMBER.fullmatch(text):
        return float(text)
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise InvalidRequest(f"{name}: cannot parse duration {text!r} (use e.g. 30s, 5m, 1h, 7d)", field=name)
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _parse_every(d: Mapping[str, Any], name: str, default: float | None) -> float | None:
    if name not in d:
        return default
    raw = d[name]
    if raw is None:
        return None
    seconds = parse_duration(raw, name)
    return None if seconds == 0 else seconds


def _parse_tiers(raw: Any) -> tuple[Tier, ...]:
    if not isinstance(raw, list | tuple):
        raise InvalidRequest("retention must be a list of {within, every} tiers", field="retention")
    if len(raw) > MAX_TIERS:
        raise InvalidRequest(f"retention has {len(raw)} tiers; at most {MAX_TIERS}", field="retention")
    tiers: list[Tier] = []
    for i, item in enumerate(raw):
        where = f"retention[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidRequest(f"{where} must be an object with within and every", field=where)
        unknown = sorted(str(k) for k in item if k not in _TIER_KEYS)
        if unknown:
            raise InvalidRequest(f"unknown field(s) {', '.join(f'{where}.{k}' for k in unknown)}",
                                 field=f"{where}.{unknown[0]}")
        missing = sorted(_TIER_KEYS - set(item))
        if missing:
            raise InvalidRequest(f"{where}.{missing[0]} is required", field=f"{where}.{missing[0]}")
        within = parse_duration(item["within"], f"{where}.within")
        every = parse_duration(item["every"], f"{where}.every")
        _check_tier(within, every, where)  # first, so errors name the user's field, not Tier's
        tiers.append(Tier(within=within, every=every))
    return tuple(tiers)


def _check_every(name: str, value: float | None, minimum: float) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a finite number of seconds or null", field=name)
    if value < minimum:
        raise InvalidRequest(f"{name} must be at least {_num(minimum)}s (or null to disable), got {_num(value)}",
                             field=name)
    if value > MAX_DURATION:
        raise InvalidRequest(f"{name} is longer than 10 years", field=name)


def _check_tier(within: Any, every: Any, where: str) -> None:
    for key, v in (("within", within), ("every", every)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise InvalidRequest(f"{where}.{key} must be a non-negative finite number of seconds",
                                 field=f"{where}.{key}")
        if v > MAX_DURATION:
            raise InvalidRequest(f"{where}.{key} is longer than 10 years", field=f"{where}.{key}")
    if within <= 0:
        raise InvalidRequest(f"{where}.within must be positive", field=f"{where}.within")
    if every > within:
        raise InvalidRequest(f"{where}.every ({_num(every)}s) is longer than its within ({_num(within)}s)",
                             field=f"{where}.every")


def _check_tiers(tiers: Any, name: str) -> None:
    if not isinstance(tiers, tuple) or not all(isinstance(t, Tier) for t in tiers):
        raise InvalidRequest(f"{name} must be a tuple of Tier", field=name)
    if len(tiers) > MAX_TIERS:
        raise InvalidRequest(f"{name} has {len(tiers)} tiers; at most {MAX_TIERS}", field=name)
    for i in range(1, len(tiers)):
        if tiers[i].within <= tiers[i - 1].within:
            raise InvalidRequest(
                f"{name}[{i}].within ({_num(tiers[i].within)}s) must be longer than "
                f"{name}[{i - 1}].within ({_num(tiers[i - 1].within)}s)",
                field=f"{name}[{i}].within",
            )


# ---- the policy --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tier:
    """Keep one snapshot per ``every`` seconds (0: all of them) among those up to ``within`` old."""

    within: float
    every: float = 0.0

    def __post_init__(self) -> None:
        _check_tier(self.within, self.every, "tier")


DEFAULT_TIERS: tuple[Tier, ...] = (
    Tier(within=3600, every=0),
    Tier(within=86400, every=3600),
    Tier(within=7 * 86400, every=86400),
)


@dataclass(frozen=True)
class SnapshotPolicy:
    """How often to snapshot and what to keep. ``None`` disables that schedule."""

    disk_every: float | None = 60.0
    full_every: float | None = 900.0
    tiers: tuple[Tier, ...] = field(default=DEFAULT_TIERS)
    #: Seconds between looks of the continuous disk backup: None takes the deployment's default
    #: (``space controller --backup-every``), 0 turns it off for this sandbox.
    backup_every: float | None = None

    def __post_init__(self) -> None:
        _check_every("disk_every", self.disk_every, MIN_DISK_EVERY)
        _check_every("full_every", self.full_every, MIN_FULL_EVERY)
        if self.backup_every != 0:
            _check_every("backup_every", self.backup_every, MIN_BACKUP_EVERY)
        _check_tiers(self.tiers, "tiers")

    def backup_interval(self, default: float | None) -> float | None:
        """Seconds between backup looks for this sandbox, or None when it is not backed up."""
        if self.backup_every is None:
            return default or None
        return self.backup_every or None

    def interval(self, kind: str) -> float | None:
        """Seconds between scheduled snapshots of ``kind``, or None when that schedule is off."""
        if kind == "disk":
            return self.disk_every
        if kind == "full":
            return self.full_every
        raise InvalidRequest(f"unknown snapshot kind {kind!r}; expected one of {', '.join(KINDS)}",
                             field="kind")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SnapshotPolicy:
        """Parse a user's (partial) policy over the defaults; every error names the bad field.

        Durations are seconds (numbers) or strings such as ``"30s"``, ``"5m"``, ``"1h30m"``,
        ``"7d"``. ``disk_every``/``full_every`` of ``null`` or ``0`` turn that schedule off.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise InvalidRequest("snapshot policy must be an object", field="snapshot_policy")
        unknown = sorted(str(k) for k in d if k not in _POLICY_KEYS)
        if unknown:
            raise InvalidRequest(f"unknown snapshot policy field(s): {', '.join(unknown)}", field=unknown[0])
        default = cls()
        disk_every = _parse_every(d, "disk_every", default.disk_every)
        full_every = _parse_every(d, "full_every", default.full_every)
        tiers = _parse_tiers(d["retention"]) if "retention" in d else default.tiers
        backup_every = None
        if "backup_every" in d:
            backup_every = 0.0 if d["backup_every"] is None else parse_duration(d["backup_every"], "backup_every")
        _check_every("disk_every", disk_every, MIN_DISK_EVERY)
        _check_every("full_every", full_every, MIN_FULL_EVERY)
        _check_tiers(tiers, "retention")
        return cls(disk_every=disk_every, full_every=full_every, tiers=tiers, backup_every=backup_every)

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON form (seconds as numbers); ``from_dict(p.to_dict()) == p``."""
        return {
            "disk_every": _num(self.disk_every),
            "full_every": _num(self.full_every),
            "retention": [{"within": _num(t.within), "every": _num(t.every)} for t in self.tiers],
            **({"backup_every": _num(self.backup_every)} if self.backup_every is not None else {}),
        }


_POLICY_KEYS = frozenset({"disk_every", "full_every", "retention", "backup_every"})
_TIER_KEYS = frozenset({"within", "every"})


@dataclass(frozen=True)
class SnapshotRef:
    """What retention needs to know about one snapshot."""

    id: str
    created_at: datetime
    kind: str
    origin: str


def due(policy: SnapshotPolicy, kind: str, last_taken: datetime | None, now: datetime) -> bool:
    """Whether the schedule should take a snapshot of ``kind`` now.

    ``last_taken`` is the newest snapshot of that kind, whatever its origin (a manual or suspend
    snapshot also resets the clock).
    """
    interval = policy.interval(kind)
    if interval is None:
        return False
    if last_taken is None:
        return True
    elapsed = _micros(now) - _micros(last_taken)
    step = _to_micros(interval)
    # A last snapshot far in the future means the clock stepped back: waiting for it to "pass"
    # would stall the schedule for as long as the step, so take one now instead.
    return elapsed >= step or elapsed < -step


def prune(snapshots: Sequence[SnapshotRef], policy: SnapshotPolicy, now: datetime,
          pinned: Collection[str] = ()) -> list[str]:
    """Ids of the snapshots retention deletes at ``now``, oldest first.

    Idempotent: pruning the survivors again at the same ``now`` deletes nothing.
    """
    pinned_ids = frozenset(pinned)
    by_kind: dict[str, list[tuple[int, str]]] = {}
    for s in snapshots:
        if s.origin == ORIGIN_SCHEDULE:
            by_kind.setdefault(s.kind, []).append((_micros(s.created_at), s.id))
    now_us = _micros(now)
    tiers = [(_to_micros(t.within), _to_micros(t.every)) for t in policy.tiers]
    doomed: list[tuple[int, str]] = []
    for timeline in by_kind.values():
        timeline.sort()
        newest = timeline[-1]
        # Bucket -> its oldest (timestamp, id); timelines are sorted, so the first seen wins.
        oldest: dict[tuple[int, int], tuple[int, str]] = {}
        for size in {e for _, e in tiers if e > 0}:
            for snap in timeline:
                oldest.setdefault((size, snap[0] // size), snap)
        for snap in timeline:
            if snap == newest or snap[1] in pinned_ids:
                continue
            every = _tier_every(tiers, now_us - snap[0])
            if every is None or (every > 0 and oldest[(every, snap[0] // every)] != snap):
                doomed.append(snap)
    doomed.sort()
    return [sid for _, sid in doomed]


def _tier_every(tiers: Sequence[tuple[int, int]], age: int) -> int | None:
    """``every`` of the tier covering ``age`` (a future snapshot counts as age 0); None: too old."""
    for within, every in tiers:
        if age <= within:
            return every
    return None
