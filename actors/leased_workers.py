"""Draft workers leased from the Ray pool: the `WorkerProvider` (ssd/transport/link.py) a
target's PoolClient uses when the engine is given `leased_workers` as its worker provider (what
the Serve app does; offline, `LLM(..., worker_provider=leased_workers)` after `ray.init()`).

acquire() leases one free worker from the lease registry and connects to it directly (torch or
grpc); discard() releases the lease, and reports the worker when it failed, so the pool stops
handing it out until Ray has restarted it and it has registered again. A daemon thread renews
every held lease each ttl/3; a target that dies stops renewing and its leases expire.

start_draft_workers() starts worker actors with the resources asked for (CPUs, GPUs, custom
resources, node labels), so that drafts land where they should; RayLeasedWorkers starts
`start_workers` of them itself when the pool has fewer free workers than that.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid

import ray

from actors.lease_registry import call_registry, get_or_create_registry
from actors.worker_actor import DraftWorkerActor
from ssd.core.config import CONNECTABLE_TRANSPORTS, EngineConfig, config_fingerprint
from ssd.core.protocol import DrafterUnavailable
from ssd.transport.link import WorkerLink

logger = logging.getLogger(__name__)

RESOURCE_KEYS = ("num_cpus", "num_gpus", "resources", "label_selector", "memory")


def _actor_options(resources: dict | None) -> dict:
    """Ray actor options from draft_worker_resources: one CPU each unless told otherwise."""
    options = {"num_cpus": 1, **(resources or {})}
    unknown = set(options) - set(RESOURCE_KEYS)
    if unknown:
        raise ValueError(f"draft_worker_resources: unknown keys {sorted(unknown)}; allowed: {list(RESOURCE_KEYS)}")
    return options


def _with_options(options: dict):
    try:
        return DraftWorkerActor.options(**options)
    except (ValueError, TypeError) as err:  # a value Ray refuses, or label_selector on a Ray without it
        raise ValueError(f"draft_worker_resources {options} refused by Ray {ray.__version__}: {err}") from err


def start_draft_workers(
    config: EngineConfig, vocab: int, n: int, registry=None, resources: dict | None = None, timeout_s: float = 300.0
) -> list:
    """Start n draft worker actors and wait until each has registered with the lease registry. A
    worker that fails to start (its draft does not load, say) raises DrafterUnavailable with its
    error; then none of the n is kept."""
    registry = registry or get_or_create_registry()
    spec = {"config": dataclasses.asdict(config), "vocab": vocab, "registry": registry}
    cls = _with_options(_actor_options(resources))
    actors = [cls.remote(spec) for _ in range(n)]
    try:
        # ping returns once __init__ did, and __init__ registers last.
        ready, pending = ray.wait([a.ping.remote() for a in actors], num_returns=n, timeout=timeout_s)
        if pending:
            raise DrafterUnavailable(
                f"{len(pending)} of {n} draft worker actors did not start within {timeout_s:.0f} s "
                "(not enough free resources? see draft_worker_resources)"
            )
        ray.get(ready)
    except ray.exceptions.RayError as err:  # an exception in __init__ ends the actor: Ray does not restart it
        _kill(actors)
        raise DrafterUnavailable(f"a draft worker actor failed to start: {err}") from err
    except BaseException:
        _kill(actors)
        raise
    return actors


def _kill(actors: list) -> None:
    for actor in actors:
        ray.kill(actor, no_restart=True)


class RayLeasedWorkers:
    """`WorkerProvider` of workers leased from the lease registry under the name `lessee` (a fresh
    one per provider unless given). Starts `start_workers` worker actors itself (placed with
    `resources`) when the pool has fewer free ones, and stops those on close()."""

    def __init__(
        self,
        config: EngineConfig,
        vocab: int,
        registry=None,
        lessee: str | None = None,
        lease_ttl_s: float = 30.0,
        start_workers: int = 0,
        resources: dict | None = None,
        acquire_timeout_s: float = 120.0,
    ) -> None:
        if config.draft_transport not in CONNECTABLE_TRANSPORTS:
            raise ValueError(
                f"Ray draft workers are reached over draft_transport 'torch' or 'grpc', not {config.draft_transport!r}"
            )
        self.config, self.vocab, self.ttl_s, self.acquire_timeout_s = config, vocab, lease_ttl_s, acquire_timeout_s
        self.registry = registry or get_or_create_registry()
        self.lessee = lessee or f"target-{uuid.uuid4().hex[:12]}"
        self.fp = config_fingerprint(config, vocab)
        self.held: dict[int, tuple[str, str]] = {}  # id(link) -> (worker id, address)
        self.actors: list = []  # workers this provider started (killed on close)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._cancelled = threading.Event()  # set by cancel(): acquire() stops waiting for a free worker
        free = sum(
            w["lessee"] is None and w["fingerprint"] in (None, self.fp)
            for w in ray.get(self.registry.snapshot.remote())
        )
        if start_workers > free:
            self.actors = start_draft_workers(config, vocab, start_workers - free, self.registry, resources)
        self._renewer = threading.Thread(target=self._renew_loop, name="ssd-lease-renewer", daemon=True)
        self._renewer.start()

    def _call(self, method: str, *args):
        """A lease registry method, on a new lease registry (which the workers join at their next
        heartbeat) if this one was lost."""
        self.registry, out = call_registry(self.registry, method, *args)
        return out

    def acquire(self) -> WorkerLink:
        end = time.monotonic() + self.acquire_timeout_s
        while True:
            try:
                leases = self._call("lease", self.lessee, 1, self.ttl_s, self.fp)
            except ray.exceptions.RayError as err:  # the pool's refill loop retries DrafterUnavailable
                raise DrafterUnavailable(f"the draft lease registry did not answer: {type(err).__name__}") from err
            if leases:
                lease = leases[0]
                try:
                    link = WorkerLink.connect(
                        lease.address,
                        self.fp,
                        self.config.draft_deadline_s,
                        f"ray worker {lease.worker_id[:8]} at {lease.address}",
                        self.config.draft_device,
                    )
                except DrafterUnavailable:
                    self.registry.report_failed.remote(
                        self.lessee, lease.worker_id, lease.address
                    )  # no wait: best effort
                    raise
                with self._lock:
                    self.held[id(link)] = (lease.worker_id, lease.address)
                return link
            if time.monotonic() > end:
                raise DrafterUnavailable(f"no free draft worker in the Ray pool within {self.acquire_timeout_s:.0f} s")
            if self._cancelled.wait(0.5):
                raise DrafterUnavailable("the draft pool is closing")

    def cancel(self) -> None:
        # A replica whose worker died waited here for a free one (up to acquire_timeout_s) when it
        # was deleted, and Ray Serve killed it after its graceful-shutdown timeout.
        self._cancelled.set()

    def discard(self, link: WorkerLink, failed: bool) -> None:
        link.kill() if failed else link.close()
        with self._lock:
            held = self.held.pop(id(link), None)
        if held is None:
            return
        worker_id, address = held
        if failed:
            # Not waited for: a failure is discarded on the engine's round, which must not wait on
            # the registry (behind a partition it would wait as long as the partition). Best
            # effort: a report that is lost leaves the lease to expire by itself.
            self.registry.report_failed.remote(self.lessee, worker_id, address)
            return
        try:
            self._call("release", self.lessee, [worker_id])
        except ray.exceptions.RayError as err:  # the lease expires by itself
            logger.warning("could not tell the pool about draft worker %s: %s", worker_id, err)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with self._lock:
                ids = [worker_id for worker_id, _ in self.held.values()]
            if not ids:
                continue
            try:
                kept = ray.get(self.registry.renew.remote(self.lessee, ids, self.ttl_s), timeout=self.ttl_s / 3)
            except ray.exceptions.RayActorError:
                logger.warning("the draft lease registry is gone; renewing with a new one from now on")
                self.registry = get_or_create_registry()
                continue
            except (ray.exceptions.RayError, TimeoutError) as err:  # try again next period; the lease lasts ttl
                logger.warning("could not renew the leases on draft workers %s: %s", sorted(ids), err)
                continue
            lost = set(ids) - set(kept)
            if lost:  # the pool gave them away (we renewed too late): the channel will fail and be replaced
                logger.warning("leases on draft workers %s expired before renewal", sorted(lost))

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            ids, self.held = [worker_id for worker_id, _ in self.held.values()], {}
        if ids:
            try:
                ray.get(self.registry.release.remote(self.lessee, ids), timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as err:  # unreleased leases expire on their own
                logger.warning("could not release the leases on draft workers %s: %s", sorted(ids), err)
        if self.actors:
            try:  # each leaves the pool itself, then goes
                ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
            except (ray.exceptions.RayError, TimeoutError) as err:
                logger.warning("draft worker actors did not all shut down cleanly: %s", err)
            _kill(self.actors)


def leased_workers(config: EngineConfig, vocab: int, lessee_prefix: str = "") -> RayLeasedWorkers:
    """The engine's worker provider (ssd.engine.proposers.WorkerProviderFactory) over the Ray pool:
    it starts the engine's draft_workers itself when config.draft_start_workers (placed with
    config.draft_worker_resources), else only leases workers others started. Its lessee name starts
    with `lessee_prefix` (a Serve application's name), which a pool that follows its lessees'
    demand counts by (LeaseTable.demand)."""
    start = config.draft_workers if config.draft_start_workers else 0
    lessee = f"{lessee_prefix}target-{uuid.uuid4().hex[:12]}"
    return RayLeasedWorkers(config, vocab, lessee=lessee, start_workers=start, resources=config.draft_worker_resources)
