"""Leases on draft workers: which target holds which worker, until when.

A worker registers its address; a target (lessee) leases free workers for `ttl_s` seconds and
renews its leases while it uses them; a lease not renewed in time expires and frees the worker,
so a target that dies gives its workers back without anybody noticing it died. A lessee releases
a worker it no longer needs, and reports one that failed under it: that worker is out of the
pool until it registers again (a restarted worker re-registers by itself).

Workers of different configurations (draft model, K, C, vocabulary: the channel fingerprint) may
share one table, as two Serve applications on one cluster do: each registers with its
fingerprint and a target leases only workers of its own.

The table also says how many workers its lessees want (`demand`): those leased, plus those a
lessee asked for and did not get, for as long as it keeps asking. A pool that sizes itself by it
grows when targets start and shrinks when they release their leases or die, with nothing set by
hand.

Invariants: a worker is leased by at most one lessee at a time; a worker is only leased to a
lessee asking for its fingerprint; an expired lease is never renewed; a re-registration (the
worker restarted) ends any lease on it.

Plain Python: a Ray actor of the serving package wraps one (the lease registry), tests drive one
with a fake clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    worker_id: str
    address: str
    lessee: str
    expires_at: float  # on the table's clock


@dataclass
class _Worker:
    address: str
    fingerprint: int | None = None  # None: leased to any lessee (one-configuration pools)
    lessee: str | None = None
    expires_at: float = 0.0


@dataclass
class _Unmet:
    fingerprint: int | None
    missing: int  # workers asked for and not leased
    asked_at: float  # on the table's clock


# A lessee that is still waiting asks again every half second (RayLeasedWorkers.acquire); one
# that stopped asking this long ago wants no more.
UNMET_FRESH_S = 5.0


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.workers: dict[str, _Worker] = {}
        self.expired = 0  # leases that ran out (their lessee stopped renewing)
        self.unmet: dict[str, _Unmet] = {}  # lessee -> its last lease call that came up short

    def _free(self, w: _Worker, now: float) -> bool:
        if w.lessee is not None and w.expires_at <= now:
            w.lessee = None
            self.expired += 1
        return w.lessee is None

    def register(self, worker_id: str, address: str, fingerprint: int | None = None) -> None:
        """A worker is (again) available at `address`; a lease on its former self ends."""
        self.workers[worker_id] = _Worker(address, fingerprint)

    def has(self, worker_id: str, address: str) -> bool:
        """Whether the worker is listed at this address (a worker checks it, to register again
        when a target's failure report or the loss of the pool dropped it)."""
        w = self.workers.get(worker_id)
        return w is not None and w.address == address

    def unregister(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def lease(self, lessee: str, n: int, ttl_s: float, fingerprint: int | None = None) -> list[Lease]:
        """Up to n free workers for `lessee`, for ttl_s seconds (fewer, or none, if fewer are free),
        of the given fingerprint (workers registered without one match any)."""
        if n < 0:
            raise ValueError(f"lease: n must be >= 0, got {n}")
        if ttl_s <= 0:
            raise ValueError(f"lease: ttl_s must be > 0, got {ttl_s}")
        now = self.clock()
        out = []
        for worker_id, w in self.workers.items():
            if len(out) == n:
                break
            if w.fingerprint not in (None, fingerprint) and fingerprint is not None:
                continue
            if self._free(w, now):
                w.lessee, w.expires_at = lessee, now + ttl_s
                out.append(Lease(worker_id, w.address, lessee, w.expires_at))
        if len(out) < n:
            self.unmet[lessee] = _Unmet(fingerprint, n - len(out), now)
        else:
            self.unmet.pop(lessee, None)
        return out

    def renew(self, lessee: str, worker_ids: list[str], ttl_s: float) -> list[str]:
        """Extend `lessee`'s leases; -> the ids it still holds (an expired one is lost)."""
        if ttl_s <= 0:
            raise ValueError(f"renew: ttl_s must be > 0, got {ttl_s}")
        now = self.clock()
        held = []
        for worker_id in worker_ids:
            w = self.workers.get(worker_id)
            if w is not None and not self._free(w, now) and w.lessee == lessee:
                w.expires_at = now + ttl_s
                held.append(worker_id)
        return held

    def release(self, lessee: str, worker_ids: list[str]) -> None:
        for worker_id in worker_ids:
            w = self.workers.get(worker_id)
            if w is not None and w.lessee == lessee:
                w.lessee = None

    def report_failed(self, lessee: str, worker_id: str, address: str | None = None) -> None:
        """`lessee` saw the worker at `address` fail: out of the pool until it registers again. A
        worker that has already re-registered (restarted, at a new address) stays."""
        w = self.workers.get(worker_id)
        if w is not None and w.lessee in (lessee, None) and address in (None, w.address):
            del self.workers[worker_id]

    def demand(self, fingerprint: int | None = None, lessees: str = "") -> int:
        """Workers of `fingerprint` (None: of any) wanted now by the lessees whose names start with
        `lessees`: the ones leased, plus the ones asked for in the last UNMET_FRESH_S seconds and not
        leased."""
        now = self.clock()
        leased = sum(
            not self._free(w, now) and w.lessee.startswith(lessees) and fingerprint in (None, w.fingerprint)
            for w in self.workers.values()
        )
        self.unmet = {k: u for k, u in self.unmet.items() if now - u.asked_at < UNMET_FRESH_S}
        waiting = sum(
            u.missing
            for lessee, u in self.unmet.items()
            if lessee.startswith(lessees) and fingerprint in (None, u.fingerprint)
        )
        return leased + waiting

    def snapshot(self) -> list[dict]:
        now = self.clock()
        return [
            {
                "worker_id": i,
                "address": w.address,
                "fingerprint": w.fingerprint,
                "lessee": None if self._free(w, now) else w.lessee,
                "expires_in_s": max(w.expires_at - now, 0.0) if w.lessee else None,
            }
            for i, w in self.workers.items()
        ]
