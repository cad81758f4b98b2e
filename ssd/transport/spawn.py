"""Draft workers as processes this one starts: the `WorkerProvider` a PoolClient uses unless the
caller passes another (such as workers leased from a Ray pool).

A worker is forked from this process's fork server (ssd/core/forked.py), which has imported
torch and the drafter once: a worker is ready to serve in the time its draft takes to load, not
the seconds an interpreter takes to import, and a dead worker's replacement joins as fast. The
caller names the function the worker runs (the engine passes the worker package's entry point),
never the caller's main module, so SSD works from stdin scripts, `python -c`, notebooks, scripts
without a `__main__` guard and Ray actors alike. The worker's spec (engine config, vocabulary,
link) travels with the fork:
- shm (the default): the descriptors of two shared-memory mailboxes (shm_channel.py), the
  lowest latency on one host;
- gloo: a private FileStore directory for a torch.distributed pair group (gloo_channel.py);
- torch, grpc: the worker listens on a port it chose, reports its address on a pipe, and is
  reached as a remote worker would be.

Placement: with draft_worker_cpus pinned each worker runs on cores of its own
(EngineConfig.draft_cpu_sets), set before its draft loads; a replacement takes the cores its
dead predecessor left.

Lifetime: a worker exits when this process closes its lifeline or dies, however it dies, and is
killed with the fork server (which ends with this process); the link shuts it down on close() or
interpreter exit, and kills it if it will not go. The fork server reaps it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict

from ssd.core.config import CONNECTABLE_TRANSPORTS, EngineConfig, config_fingerprint, cpu_ids
from ssd.core.forked import ForkedProcess, fork
from ssd.core.protocol import DrafterUnavailable
from ssd.transport.channel import ChannelClosed
from ssd.transport.link import CONNECT_TIMEOUT, WorkerLink, await_ready
from ssd.transport.shm_board import BoardReader, supported

logger = logging.getLogger(__name__)

WORKER_NAME = "ssd-draft-worker"  # what `ps -e`, `top` and `pgrep ssd-draft` show (15 bytes of it)

# A worker's entry point: (ForkedChild, spec) -> exit code (ssd.worker.main.run_forked).
WorkerMain = Callable[..., int]


class SpawnedWorkers:
    """`WorkerProvider` of worker processes that this process forks: each acquire() forks one
    with its spec and waits until it is ready, discard() stops it (kills it when it failed). A
    pool over this provider restarts a dead worker by acquiring a new one. worker_main: what the
    worker runs; preload: the modules it imports, for the fork server to import once."""

    def __init__(self, config: EngineConfig, vocab: int, worker_main: WorkerMain, preload: Sequence[str] = ()) -> None:
        self.config, self.vocab = config, vocab
        self.fp = config_fingerprint(config, vocab)
        self.worker_main, self.preload = worker_main, tuple(preload)
        self.feed = None  # the shm workers' feed (shm_feed.FeedWriter), made with the first of them
        self.lock = threading.Lock()  # refills acquire workers from threads of their own
        # Cores of each worker's own ([]: the OS places them); a replacement takes the freed ones.
        self.cpu_sets = config.draft_cpu_sets(cpu_ids())
        self.placed: list[tuple[ForkedProcess, int]] = []  # (worker, index of its cpu set)
        self.placing = threading.Lock()

    def acquire(self) -> WorkerLink:
        transport = self.config.draft_transport
        if transport in CONNECTABLE_TRANSPORTS:
            return self._listening()
        if transport == "gloo":
            return self._gloo_pair()
        return self._shm_pair()

    def discard(self, link: WorkerLink, failed: bool) -> None:
        link.kill() if failed else link.close()

    def cancel(self) -> None:
        """Nothing waits here but a starting worker, which the pool discards once it is up."""

    def close(self) -> None:
        """Unmap the feed; nothing to stop: each link owns its worker, and the fork server ends with
        this process."""
        with self.lock:
            feed, self.feed = self.feed, None
        if feed is not None:
            feed.close()

    def _fork(self, link: dict, fds: Sequence[int] = ()) -> ForkedProcess:
        if not self.cpu_sets:
            return fork(self.worker_main, (self._spec(link, None),), fds, WORKER_NAME, self.preload)
        with self.placing:  # a set is chosen and taken at once (refills fork from threads of their own)
            index = self._free_cpu_set()
            spec = self._spec(link, list(self.cpu_sets[index]))
            process = fork(self.worker_main, (spec,), fds, WORKER_NAME, self.preload)
            self.placed.append((process, index))
            return process

    def _spec(self, link: dict, cpus: list[int] | None) -> dict:
        return {
            "config": asdict(self.config),
            "vocab": self.vocab,
            "log_level": logging.getLogger("ssd").getEffectiveLevel(),
            "link": link,
            "cpus": cpus,
        }

    def _free_cpu_set(self) -> int:
        """The cpu set held by the fewest live workers (a dead worker's, when one is being
        replaced)."""
        self.placed = [(p, i) for p, i in self.placed if p.poll() is None]
        held = [0] * len(self.cpu_sets)
        for _, i in self.placed:
            held[i] += 1
        return held.index(min(held))

    def _shm_pair(self) -> WorkerLink:
        from ssd.transport.shm_channel import SPIN_S, Mailbox, MailboxReader, ShmChannel

        to_target = Mailbox.create()
        # What the target writes reaches its workers through the pool's feed (shm_feed.py) where
        # the host keeps stores in order, else through a mailbox of the worker's own.
        port = self._feed().port() if supported() else None
        to_draft = Mailbox.create() if port is None else None
        # Where its worker publishes what it prepares (shm_board.py); not with ssd_reproducible, whose
        # answers wait for whole trees (a board is read at whatever depth the outcome finds).
        board = BoardReader.create() if supported() and not self.config.ssd_reproducible else None
        ends = [e for e in (to_target, to_draft, port, board) if e is not None]
        try:
            link = {
                "kind": "shm", "outbox": asdict(to_target.handle), "spin_s": self.config.draft_spin_ms / 1000,
                "inbox": None if to_draft is None else asdict(to_draft.handle),
                "feed": None if port is None else port.handle(),
                "board": None if board is None else asdict(board.handle),
            }  # fmt: skip
            fds = to_target.handle.fds() + (to_draft.handle.fds() if port is None else port.fds())
            process = self._fork(link, fds + (() if board is None else (board.handle.fd,)))
        except BaseException:
            for end in ends:
                end.close()
            raise
        # The worker holds its own copies of the descriptors; the mappings stay ours.
        alive = lambda: process.poll() is None  # noqa: E731
        if port is None:
            channel = ShmChannel.of(to_target, to_draft, self.fp, alive)
        else:
            port.alive = alive
            channel = ShmChannel(MailboxReader(to_target, alive, SPIN_S), port, self.fp)
        return self._paired(process, channel, board=board, feed=port)

    def _feed(self):
        """The feed every shm worker of this provider reads (made with the first of them)."""
        from ssd.transport.shm_feed import FeedWriter

        with self.lock:
            if self.feed is None:
                self.feed = FeedWriter()
            return self.feed

    def _gloo_pair(self) -> WorkerLink:
        from ssd.transport.gloo_channel import WorkerGone, await_worker, pair_group, pair_store
        from ssd.transport.torch_channel import TorchChannel

        store_dir = tempfile.mkdtemp(prefix="ssd-pair-")
        cleanup = lambda: shutil.rmtree(store_dir, ignore_errors=True)  # noqa: E731
        try:
            process = self._fork({"kind": "gloo", "store_dir": store_dir})
            try:
                store = pair_store(store_dir)
                await_worker(store, lambda: process.poll() is None, process.poll)
                channel = TorchChannel(pair_group(store, 0), 1, self.fp)
            except BaseException:
                _stop(process)
                raise
        except WorkerGone as err:
            cleanup()
            raise DrafterUnavailable(str(err)) from err
        except BaseException:
            cleanup()
            raise
        return self._paired(process, channel, cleanup)

    def _paired(
        self, process: ForkedProcess, channel, cleanup: Callable[[], None] | None = None, board=None, feed=None
    ) -> WorkerLink:
        """A worker over a channel of its own (shm mailboxes or a gloo pair), once it is READY."""
        try:
            try:
                await_ready(channel, f"draft worker pid {process.pid}", CONNECT_TIMEOUT)
            except ChannelClosed as err:
                raise DrafterUnavailable(f"draft worker exited with code {process.poll()} before it was ready") from err
        except BaseException:
            _stop(process)
            channel.close(peer_exited=True)
            if cleanup is not None:
                cleanup()
            if board is not None:
                board.close()
            raise
        logger.info("draft worker pid %d ready (%s channel)", process.pid, self.config.draft_transport)
        name, deadline_s = f"pid {process.pid}", self.config.draft_deadline_s
        return WorkerLink(channel, name, deadline_s, process, cleanup=cleanup, board=board, feed=feed)

    def _listening(self) -> WorkerLink:
        """A worker that listens on a port of its own choosing (torch or grpc), reached through
        that transport as a remote worker would be; it reports its address once it is ready."""
        report, theirs = os.pipe()
        try:
            link = {
                "kind": "listen",
                "transport": self.config.draft_transport,
                "host": "127.0.0.1",
                "report_fd": theirs,
            }
            process = self._fork(link, [theirs])
        finally:
            os.close(theirs)  # the worker holds its own copy: EOF here once it exits
        try:
            with os.fdopen(report) as lines:
                line = lines.readline()  # the model loads first; EOF if the worker died
            if not line:
                raise DrafterUnavailable(f"draft worker exited with code {process.wait(5)} before listening")
            address = json.loads(line)["address"]
            return WorkerLink.connect(
                address, self.fp, self.config.draft_deadline_s, f"pid {process.pid} at {address}",
                self.config.draft_device, process=process,
            )  # fmt: skip
        except BaseException:
            _stop(process)
            raise


def _stop(process: ForkedProcess) -> None:
    """Kill a worker that will not be used, and wait until the fork server reaped it."""
    process.kill()
    process.wait(5)
