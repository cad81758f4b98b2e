"""The lease registry of the shared pool of draft workers, as a Ray actor: a LeaseTable
(ssd/transport/leases.py) behind a named actor, so every target of a cluster finds the same one.

The registry holds no model and no channel: workers register their addresses, targets lease
workers and then talk to them directly. It takes no CPU (num_cpus=0), so it never competes
with a worker for one.

Lifetime: detached. Whoever calls get_or_create_registry first creates it, and that is an
arbitrary target replica or driver; an owned actor would die with it and take every other
target's leases and every worker's registration along. Detached, it lives as long as the
cluster; `ray.kill` it to remove it. It is named in an explicit namespace ("ssd"), so drivers
and Serve replicas in namespaces of their own find the same one. It is not restarted by Ray. If
it is lost anyway (its node died, or someone killed it), the next get_or_create_registry creates
an empty one: every worker checks its listing each heartbeat (PoolMember) and registers with the
new registry, and targets (RayLeasedWorkers) move to it at their next call. Leases held at the
loss are not carried over: their channels keep working, and the new registry may lease a busy
worker to another target, whose connection then waits for the worker's current session and fails
over if it outlasts the deadline.
"""

from __future__ import annotations

import logging

import ray

from ssd.transport.leases import Lease, LeaseTable

logger = logging.getLogger(__name__)

REGISTRY_NAME = "ssd-lease-registry"
REGISTRY_NAMESPACE = "ssd"


@ray.remote(num_cpus=0)
class LeaseRegistryActor:
    """Each method is the LeaseTable's (see there). Ray titles its process `ray::LeaseRegistryActor`."""

    def __init__(self) -> None:
        self.table = LeaseTable()

    def register(self, worker_id: str, address: str, fingerprint: int | None = None) -> None:
        self.table.register(worker_id, address, fingerprint)

    def has(self, worker_id: str, address: str) -> bool:
        return self.table.has(worker_id, address)

    def unregister(self, worker_id: str) -> None:
        self.table.unregister(worker_id)

    def lease(self, lessee: str, n: int, ttl_s: float, fingerprint: int | None = None) -> list[Lease]:
        return self.table.lease(lessee, n, ttl_s, fingerprint)

    def renew(self, lessee: str, worker_ids: list[str], ttl_s: float) -> list[str]:
        return self.table.renew(lessee, worker_ids, ttl_s)

    def release(self, lessee: str, worker_ids: list[str]) -> None:
        self.table.release(lessee, worker_ids)

    def report_failed(self, lessee: str, worker_id: str, address: str | None = None) -> None:
        self.table.report_failed(lessee, worker_id, address)

    def demand(self, fingerprint: int | None = None, lessees: str = "") -> int:
        return self.table.demand(fingerprint, lessees)

    def snapshot(self) -> list[dict]:
        return self.table.snapshot()


def get_or_create_registry(name: str = REGISTRY_NAME, namespace: str = REGISTRY_NAMESPACE):
    """The cluster's lease registry (created on first use; needs ray.init beforehand)."""
    return LeaseRegistryActor.options(name=name, namespace=namespace, get_if_exists=True, lifetime="detached").remote()


def call_registry(registry, method: str, *args):
    """registry.method(*args) -> (the registry handle to use from now on, the result). A registry that
    was lost is replaced by a new one (get_or_create_registry), and the call is made there."""
    try:
        return registry, ray.get(getattr(registry, method).remote(*args))
    except ray.exceptions.RayActorError:
        logger.warning("the draft lease registry is gone; moving to a new one")
        registry = get_or_create_registry()
        return registry, ray.get(getattr(registry, method).remote(*args))
