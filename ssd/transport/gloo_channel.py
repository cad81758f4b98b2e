"""A `Channel` over a torch.distributed gloo pair group: the layout of a drafter on another host
(on GPUs the same layout would travel over NCCL).

The pair group is stateless: created from a private FileStore (no port to choose, none fixed)
with ProcessGroupGloo on loopback, never the default group, so several pairs can live in one
process. Messages are the frames of ssd/transport/wire.py in two transfers (header, then body).
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import torch
import torch.distributed as dist

from ssd.transport.wire import HEADER, MsgType, body_size, encode, frame, unframe

CONNECT_TIMEOUT = datetime.timedelta(seconds=180)
# The group's own timeout bounds every blocking op without an explicit deadline (the worker's
# wait for the next message between requests can be long).
GROUP_TIMEOUT = datetime.timedelta(days=7)
_TAG = 0
JOINING_KEY = "worker-joining"


class WorkerGone(RuntimeError):
    """The worker process died or never joined the pair group."""


def pair_store(store_dir: str) -> dist.FileStore:
    store = dist.FileStore(os.path.join(store_dir, "store"), 2)
    store.set_timeout(CONNECT_TIMEOUT)
    return store


def pair_group(store: dist.Store, rank: int) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = GROUP_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, 2, opts)


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


class _Posted:
    """A posted receive of the next header, and whether it has arrived.

    Gloo's Work.is_completed() stays False until wait() is called (it does not track arrival),
    so a busy drafter cannot learn from it that the target's outcome is in. A helper thread
    waits instead (wait() releases the GIL) and sets an Event that the drafter polls between
    tree depths; arrived() is that Event."""

    def __init__(self, group: dist.ProcessGroup, peer: int) -> None:
        self.header = torch.zeros(HEADER, dtype=torch.long)
        self._work = group.recv([self.header], peer, _TAG)
        self._done = threading.Event()
        self._error: RuntimeError | None = None
        threading.Thread(target=self._wait, name="ssd-next-message", daemon=True).start()

    def _wait(self) -> None:
        try:
            self._work.wait()
        except RuntimeError as err:  # the peer is gone; wait() re-raises it in the caller
            self._error = err
        finally:
            self._done.set()

    def arrived(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: datetime.timedelta | None) -> torch.Tensor:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"no message within {timeout.total_seconds():g} s")
        if self._error is not None:
            raise self._error
        return self.header


class GlooChannel:
    """Typed send/recv over a pair group; peer = the other rank."""

    def __init__(self, group: dist.ProcessGroup, peer: int, fp: int) -> None:
        self.group, self.peer, self.fp = group, peer, fp
        self._posted: _Posted | None = None

    def send_raw(
        self, kind: MsgType, round_id: int, ints: torch.Tensor, floats: torch.Tensor,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        """Two transfers per message: the header, then one byte body (ints, then floats), both
        posted before waiting (each gloo transfer costs a round trip with the peer). A gloo send
        completes only once the peer posts its receive, so a stalled peer blocks the sender:
        callers that must not hang pass a timeout."""
        header, body = frame(kind, round_id, ints, floats, self.fp)
        works = [self.group.send([header], self.peer, _TAG)]
        if body.numel():
            works.append(self.group.send([body], self.peer, _TAG))
        for work in works:
            work.wait() if timeout is None else work.wait(timeout)

    def send(self, msg, timeout: datetime.timedelta | None = None) -> None:
        self.send_raw(*encode(msg), timeout=timeout)

    def poll(self) -> bool:
        """Whether the next message's header has arrived (posts its receive on first call)."""
        if self._posted is None:
            self._posted = _Posted(self.group, self.peer)
        return self._posted.arrived()

    def recv(self, timeout: datetime.timedelta | None = None):
        """-> (MsgType, message or None for bodiless control messages, ints)"""
        if self._posted is not None:
            posted, self._posted = self._posted, None
            header = posted.wait(timeout)
        else:
            header = torch.zeros(HEADER, dtype=torch.long)
            self._recv(header, timeout)
        body = torch.zeros(body_size(header, self.fp), dtype=torch.uint8)
        if body.numel():
            self._recv(body, timeout)
        return unframe(header, body)

    def _recv(self, t: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        work = self.group.recv([t], self.peer, _TAG)
        work.wait() if timeout is None else work.wait(timeout)

    def close(self) -> None:
        self._posted = None
