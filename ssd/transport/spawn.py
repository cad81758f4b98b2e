"""Draft workers as child processes of this one: the `WorkerProvider` a PoolClient uses unless the
caller passes another (such as workers leased from a Ray pool).

A worker is started as `python -m <worker_module>` (the caller names the module: the engine
passes the worker package's entry point), never by re-running the caller's main module, so SSD
works from stdin scripts, `python -c`, notebooks, scripts without a `__main__` guard and Ray
actors alike. It reads its spec (engine config, vocabulary, link) as JSON on stdin.
- shm (the default): the spec passes the file descriptors of two shared-memory mailboxes
  (shm_channel.py), the lowest latency on one host;
- gloo: a private FileStore directory for a torch.distributed pair group (gloo_channel.py);
- torch, grpc: the worker listens on a port it chose, prints its address as one JSON line, and is
  reached as a remote worker would be.

Lifetime: the worker asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG, which
follows the *thread* that started it: every worker is started from one long-lived thread), the
link shuts it down on close() or interpreter exit, and kills it if it will not go.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

from ssd.core.config import CONNECTABLE_TRANSPORTS, EngineConfig, config_fingerprint
from ssd.core.protocol import DrafterUnavailable
from ssd.transport.channel import ChannelClosed
from ssd.transport.link import CONNECT_TIMEOUT, WorkerLink, await_ready

logger = logging.getLogger(__name__)

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding ssd/ (this is ssd/transport/)


def worker_env() -> dict[str, str]:
    """The worker imports this very package, wherever the caller found it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return env


class SpawnedWorkers:
    """`WorkerProvider` of worker processes that this process starts: each acquire() spawns one
    running `python -m worker_module`, discard() stops it (kills it when it failed). A pool over
    this provider restarts a dead worker by acquiring a new one."""

    def __init__(self, config: EngineConfig, vocab: int, worker_module: str) -> None:
        self.config, self.vocab, self.worker_module = config, vocab, worker_module
        self.fp = config_fingerprint(config, vocab)
        # Every worker is started from this one thread, which lives as long as the provider: a
        # worker started from a thread that then exits (a refill thread, a server's request
        # thread) would be killed by its parent-death signal at once.
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssd-draft-starter")

    def acquire(self) -> WorkerLink:
        if self.config.draft_transport in CONNECTABLE_TRANSPORTS:
            return self._spawn_listening()
        return self._spawn_paired()

    def discard(self, link: WorkerLink, failed: bool) -> None:
        link.kill() if failed else link.close()

    def close(self) -> None:
        self._starter.shutdown(wait=False)

    def _spec(self, link: dict) -> dict:
        return {
            "config": asdict(self.config),
            "vocab": self.vocab,
            "log_level": logging.getLogger("ssd").getEffectiveLevel(),
            "link": link,
        }

    def _start(self, spec: dict, **popen) -> subprocess.Popen:
        """The worker process, started from the long-lived thread, its spec written to stdin."""
        command = [sys.executable, "-m", self.worker_module]
        args = {"stdin": subprocess.PIPE, "env": worker_env(), "close_fds": True, **popen}
        process = self._starter.submit(subprocess.Popen, command, **args).result()
        try:
            process.stdin.write(json.dumps(spec).encode())
            process.stdin.close()
        except BaseException:
            process.kill()
            process.wait(5)
            raise
        return process

    def _spawn_paired(self) -> WorkerLink:
        """A worker over a channel of its own (shm mailboxes or a gloo pair), once it is READY."""
        from ssd.transport.shm_channel import Mailbox, ShmChannel

        shm = self.config.draft_transport == "shm"
        boxes, store_dir, fds = (), None, ()
        if shm:
            boxes = to_draft, to_target = Mailbox.create(), Mailbox.create()
            link = {
                "kind": "shm", "inbox": asdict(to_draft.handle), "outbox": asdict(to_target.handle),
                "parent_pid": os.getpid(), "spin_s": self.config.draft_spin_ms / 1000,
            }  # fmt: skip
            fds = to_draft.handle.fds() + to_target.handle.fds()
        else:
            store_dir = tempfile.mkdtemp(prefix="ssd-pair-")
            link = {"kind": "gloo", "store_dir": store_dir}
        process = self._start(self._spec(link), pass_fds=fds)
        try:
            alive = lambda: process.poll() is None  # noqa: E731
            channel = ShmChannel(to_target, to_draft, self.fp, alive) if shm else self._gloo(store_dir, process)
            try:
                await_ready(channel, f"draft worker pid {process.pid}", CONNECT_TIMEOUT)
            except ChannelClosed as err:
                raise DrafterUnavailable(f"draft worker exited with code {process.poll()} before it was ready") from err
        except BaseException:
            process.kill()
            process.wait(5)
            for box in boxes:
                box.close()
            if store_dir is not None:
                shutil.rmtree(store_dir, ignore_errors=True)
            raise
        # The worker holds its own copies of the mailbox descriptors; the mappings stay ours.
        logger.info("draft worker pid %d ready (%s channel)", process.pid, self.config.draft_transport)
        cleanup = (lambda: shutil.rmtree(store_dir, ignore_errors=True)) if store_dir is not None else None
        return WorkerLink(channel, f"pid {process.pid}", self.config.draft_deadline_s, process, cleanup=cleanup)

    def _gloo(self, store_dir: str, process: subprocess.Popen):
        from ssd.transport.gloo_channel import WorkerGone, await_worker, pair_group, pair_store
        from ssd.transport.torch_channel import TorchChannel

        store = pair_store(store_dir)
        try:
            await_worker(store, lambda: process.poll() is None, process.poll)
        except WorkerGone as err:
            raise DrafterUnavailable(str(err)) from err
        return TorchChannel(pair_group(store, 0), 1, self.fp)

    def _spawn_listening(self) -> WorkerLink:
        """A worker process that listens on a port of its own choosing (torch or grpc), reached
        through that transport as a remote worker would be; it prints its address when ready."""
        link = {"kind": "listen", "transport": self.config.draft_transport, "host": "127.0.0.1"}
        process = self._start(self._spec(link), stdout=subprocess.PIPE)
        try:
            line = process.stdout.readline()  # the model loads first; EOF if the worker died
            if not line:
                raise DrafterUnavailable(f"draft worker exited with code {process.wait(5)} before listening")
            address = json.loads(line)["address"]
            return WorkerLink.connect(
                address, self.fp, self.config.draft_deadline_s, f"pid {process.pid} at {address}",
                self.config.draft_device, process=process,
            )  # fmt: skip
        except BaseException:
            process.kill()
            process.wait(5)
            raise
