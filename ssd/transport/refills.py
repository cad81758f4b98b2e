"""Replacements for a pool's lost workers: acquired in background threads, handed to the pool at
its next round boundary.

A shard whose worker was lost gets one refill thread. It waits out the shard's backoff (a worker
that failed before its first reply will likely fail again), then asks the provider for a worker,
retrying with a doubling delay while none can be had. The worker it gets waits in `ready` until
the pool takes it between rounds (take_ready). close() stops every refill: one waiting gives up,
one whose worker is starting discards that worker once started, so none outlives the pool.
"""

from __future__ import annotations

import logging
import threading

from ssd.core.protocol import DrafterUnavailable
from ssd.transport.link import WorkerLink, WorkerProvider

logger = logging.getLogger(__name__)

CLOSE_REFILL_WAIT_S = 120.0  # a worker being started when the pool closes: its model load, then READY
FIRST_RETRY_S, LAST_RETRY_S = 0.5, 30.0


class Refills:
    """The refill threads of one pool, over its provider."""

    def __init__(self, provider: WorkerProvider) -> None:
        self.provider = provider
        self._ready: list[tuple[int, WorkerLink]] = []  # (shard, worker) waiting for a round boundary
        self._lock = threading.Lock()
        self._closed = False
        self._closing = threading.Event()  # wakes refills that are waiting
        self._threads: list[threading.Thread] = []  # close() waits for them

    def start(self, w: int, backoff_s: float) -> None:
        """A new worker for shard w, after backoff_s; no-op once closed."""
        if self._closed:
            return
        thread = threading.Thread(target=self._acquire, args=(w, backoff_s), name=f"ssd-draft-refill-{w}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def take_ready(self) -> list[tuple[int, WorkerLink]]:
        """The workers acquired since the last call, by shard (the pool attaches them now)."""
        with self._lock:
            ready, self._ready = self._ready, []
        return ready

    def _acquire(self, w: int, backoff_s: float) -> None:
        if self._closing.wait(backoff_s):
            return
        delay = FIRST_RETRY_S
        while not self._closed:
            try:
                link = self.provider.acquire()
            except DrafterUnavailable as err:
                if self._closed:  # cancelled by close()
                    return
                logger.warning("no replacement for draft shard %d yet (%s); retrying in %.1f s", w, err, delay)
                if self._closing.wait(delay):
                    return
                delay = min(delay * 2, LAST_RETRY_S)
                continue
            with self._lock:
                if self._closed:
                    self.provider.discard(link, failed=False)
                else:
                    self._ready.append((w, link))
            return

    def close(self) -> None:
        """Stop every refill and give back the workers they acquired (the provider stays open)."""
        with self._lock:
            self._closed = True
        self._closing.set()
        self.provider.cancel()  # a refill waiting for a free worker stops waiting
        for thread in self._threads:  # a refill that is starting a worker discards it once started
            thread.join(CLOSE_REFILL_WAIT_S)
            if thread.is_alive():
                logger.error("a draft worker refill did not finish within %.0f s of close()", CLOSE_REFILL_WAIT_S)
        for _, link in self.take_ready():
            self.provider.discard(link, failed=False)
