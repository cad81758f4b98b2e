"""A draft worker as a Ray actor: ssd's plain worker (ssd/worker/: load the draft, listen on a
port the OS picks, serve one target session at a time) in a thread of the actor, registered with
the lease registry under its Ray actor id.

Restarts: started with max_restarts=-1, a worker that dies (its node, its process, `ray.kill`
without no_restart) is restarted by Ray, which re-runs __init__: it loads the draft again,
listens on a new port and registers its new address under the same actor id, which frees any
lease on its former self. It rejoins the pool without operator action.

Ray titles an actor's process after its class: `ray::DraftWorkerActor` in `ps` (the class is
defined under that name for this reason; a wrapper `ray.remote(DraftWorker)` would be titled
`ray::DraftWorker`).
"""

from __future__ import annotations

import logging
import threading

import ray

from ssd.core.config import EngineConfig, config_fingerprint
from ssd.core.threads import set_process_threads
from ssd.transport.connect import make_listener
from ssd.worker.main import load_drafter, serve_sessions

logger = logging.getLogger(__name__)


class PoolMember:
    """A draft worker serving sessions in a thread of this process, registered with the lease
    registry under `worker_id` once it listens. Used by DraftWorkerActor and by the Serve app's
    draft pool deployment (serve_app/deployments.py)."""

    def __init__(self, cfg: EngineConfig, vocab: int, registry, worker_id: str, heartbeat_s: float = 5.0) -> None:
        set_process_threads(cfg.draft_num_threads)
        self.worker_id, self.registry, self.heartbeat_s = worker_id, registry, heartbeat_s
        self.listener = make_listener(cfg.draft_transport, ray.util.get_node_ip_address(), cfg.draft_device)
        drafter = load_drafter(cfg, vocab)
        self.drafter = drafter  # read by held(); driven by the session thread only
        self.stop = threading.Event()
        self.fp = config_fingerprint(cfg, vocab)
        self.thread = threading.Thread(
            target=serve_sessions,
            args=(drafter, self.listener, self.fp, not cfg.ssd_reproducible, self.stop),
            name="ssd-draft-sessions",
            daemon=True,
        )
        self.thread.start()
        # Registered only once it serves: a target that leases it can connect at once.
        self._registry_call("register", self.worker_id, self.listener.address, self.fp)
        logger.info("draft worker %s listening at %s", self.worker_id, self.listener.address)
        self.heartbeat = threading.Thread(target=self._heartbeat, name="ssd-pool-heartbeat", daemon=True)
        self.heartbeat.start()

    def _registry_call(self, method: str, *args):
        """A lease registry method, on a new lease registry if the one this worker knew was lost (a
        restarted actor is given the handle of its first start)."""
        from actors.lease_registry import call_registry

        self.registry, out = call_registry(self.registry, method, *args)
        return out

    def _heartbeat(self) -> None:
        """Every heartbeat_s: register again if the pool no longer lists this worker. A target
        that saw it fail (a stall past the deadline, a broken connection) drops it from the pool;
        a lease registry that was lost comes back empty. Either way a live worker rejoins by itself."""
        while not self.stop.wait(self.heartbeat_s):
            try:
                if self._registry_call("has", self.worker_id, self.listener.address) or self.stop.is_set():
                    continue
                self._registry_call("register", self.worker_id, self.listener.address, self.fp)
                logger.info("draft worker %s registered again at %s", self.worker_id, self.listener.address)
            except ray.exceptions.RayError as err:  # next heartbeat tries again
                logger.warning("draft worker %s could not reach the pool: %s", self.worker_id, err)

    def alive(self) -> bool:
        return self.thread.is_alive()

    def held(self) -> dict:
        """What the worker holds for targets: sequences with draft state and rows of its draft KV
        cache (both 0 when no target has a sequence running here). Read from another thread:
        a snapshot that may be one message old."""
        return self.drafter.held()

    def shutdown(self) -> None:
        """Stop serving and leave the pool."""
        self.stop.set()
        self.listener.close()
        try:
            ray.get(self.registry.unregister.remote(self.worker_id))
        except ray.exceptions.RayError as err:  # the pool is gone: nothing to leave
            logger.warning("draft worker %s could not leave the pool: %s", self.worker_id, err)


@ray.remote(max_restarts=-1, max_task_retries=-1)
class DraftWorkerActor:
    """spec: {"config": EngineConfig fields, "vocab": int, "registry": lease registry handle}. The same
    spec is kept by Ray and given to every restart."""

    def __init__(self, spec: dict) -> None:
        # The actor id is stable across restarts: a restarted worker replaces its former self.
        self.member = PoolMember(
            EngineConfig(**spec["config"]), spec["vocab"], spec["registry"], ray.get_runtime_context().get_actor_id()
        )

    def address(self) -> str:
        return self.member.listener.address

    def ping(self) -> bool:
        return self.member.alive()

    def shutdown(self) -> None:
        """Stop serving and leave the pool (the actor itself stays until killed)."""
        self.member.shutdown()
