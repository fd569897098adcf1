"""Leases on singleton jobs: one holder at a time, judged by the database's clock, with a fence.

Several controllers run at once; one of them (the holder of the ``leader`` lease) runs the jobs
that must not run twice at the same moment. Expiry is measured on one clock for everyone: the
database server's on PostgreSQL (the controllers' own clocks may disagree by seconds), this
machine's on SQLite (one machine anyway). The fence grows by one whenever the holder changes, so
anything stamped with a fence can be told apart from the current holder's work.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import update

from space.errors import Conflict, InvalidRequest
from space.store.base import StoreBase, _rowcount, log
from space.store.models import Lease


class LeaseStore(StoreBase):
    """Named leases."""

    async def acquire_lease(self, name: str, holder: str, seconds: float) -> int | None:
        """Take the lease ``name`` for ``seconds``, or extend it if ``holder`` holds it already.

        Returns the fence while ``holder`` holds it, None while someone else does. A lease that
        expired passes to the next caller with the fence increased, even to its old holder (which
        must have stopped its work when it could not renew in time)."""
        if seconds <= 0:
            raise InvalidRequest(f"a lease must last some time, not {seconds} s")
        try:
            async with self._tx() as s:
                now = await self._db_now(s)
                until = now + dt.timedelta(seconds=seconds)
                row = await s.get(Lease, name, with_for_update=True)
                if row is None:
                    s.add(Lease(name=name, holder=holder, fence=1, expires_at=until, acquired_at=now))
                    fence = 1
                elif row.holder == holder and row.expires_at > now:
                    row.expires_at = until
                    return row.fence
                elif row.expires_at <= now:
                    previous = row.holder
                    row.holder, row.fence, row.expires_at, row.acquired_at = holder, row.fence + 1, until, now
                    fence = row.fence
                    log.info("lease taken over", lease=name, holder=holder, previous=previous, fence=fence)
                    return fence
                else:
                    return None
        except Conflict:
            return None  # another caller inserted the first row at the same moment: it holds it
        log.info("lease created", lease=name, holder=holder, fence=fence)
        return fence

    async def release_lease(self, name: str, holder: str) -> bool:
        """Give the lease up at once (a clean shutdown: the next holder need not wait it out)."""
        async with self._tx() as s:
            now = await self._db_now(s)
            res = await s.execute(
                update(Lease).where(Lease.name == name, Lease.holder == holder, Lease.expires_at > now)
                .values(expires_at=now).execution_options(synchronize_session=False)
            )
            return _rowcount(res) == 1

    async def get_lease(self, name: str) -> Lease | None:
        """The lease's row (its holder may have let it expire: compare ``expires_at``)."""
        async with self._tx(write=False) as s:
            return await s.get(Lease, name)
