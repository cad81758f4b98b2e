"""The gloo transport: the target spawns its worker as a child process (spawn.py) and both build a
gloo pair group from a FileStore in a private directory (no port to choose, none fixed). The
channel itself is torch_channel.py's `TorchChannel`; what is here is the start-up rendezvous of
that child. A worker on another host listens with `TorchListener` instead.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from ssd.transport.torch_channel import new_pair_group

CONNECT_TIMEOUT = datetime.timedelta(seconds=180)
JOINING_KEY = "worker-joining"


class WorkerGone(RuntimeError):
    """The worker process died or never joined the pair group."""


def pair_store(store_dir: str) -> dist.FileStore:
    store = dist.FileStore(os.path.join(store_dir, "store"), 2)
    store.set_timeout(CONNECT_TIMEOUT)
    return store


def pair_group(store: dist.Store, rank: int) -> dist.ProcessGroup:
    """The gloo pair group on loopback (blocks until both ranks joined)."""
    return new_pair_group(store, rank, "cpu", "127.0.0.1", CONNECT_TIMEOUT)


def await_worker(store: dist.Store, alive, exitcode) -> None:
    """Wait until the worker announces that it is joining the pair group. A worker that dies on
    the way (a failed import, a killed interpreter) is reported at once instead of after the
    group's connect timeout. alive() -> bool, exitcode() -> int | None."""
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    while not store.check([JOINING_KEY]):
        if not alive():
            raise WorkerGone(f"draft worker exited with code {exitcode()} before connecting")
        if time.monotonic() > deadline:
            raise WorkerGone(f"draft worker did not connect within {CONNECT_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.02)
