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

Prestarting: a worker process spends most of its start importing torch and the drafter (2.4 s
on the project's 2-core CPU, against 0.3 s to load the demo draft), and none of that needs its
spec. So a `WorkerStarter` may start the processes before the spec is known (the engine's caller
does, before it loads the models, which then load while the workers import); each waits on
stdin, and acquire() writes the spec of the one it takes. Without a process waiting, acquire()
starts one then.

Lifetime: the worker asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG, which
follows the *thread* that started it: every worker is started from one long-lived thread, the
starter's), the link shuts it down on close() or interpreter exit, and kills it if it will not
go; a prestarted process nobody took is killed when its starter closes.
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
from dataclasses import asdict, dataclass
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


@dataclass
class _Started:
    """A worker process waiting on stdin for its spec, and what its link needs (for shm: the two
    mailboxes, whose descriptors it inherited; for gloo: the rendezvous directory)."""

    process: subprocess.Popen
    link: dict
    boxes: tuple = ()
    store_dir: str | None = None

    def discard(self) -> None:
        """Kill the process (if it runs) and free what its link held."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(5)
        for box in self.boxes:
            box.close()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)


class WorkerStarter:
    """Starts worker processes (`python -m worker_module`) from one long-lived thread, for the
    transport of `config`, before their spec is known; prestart(n) starts n to be taken later."""

    def __init__(self, config: EngineConfig, worker_module: str) -> None:
        self.config, self.worker_module = config, worker_module
        # Every worker is started from this one thread, which lives as long as the starter: a
        # worker started from a thread that then exits (a refill thread, a server's request
        # thread) would be killed by its parent-death signal at once.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssd-draft-starter")
        self._waiting: list[_Started] = []

    def prestart(self, count: int) -> WorkerStarter:
        self._waiting += [self.start() for _ in range(count)]
        return self

    def take(self) -> _Started:
        """A started process: a prestarted one if any is left, else one started now."""
        return self._waiting.pop(0) if self._waiting else self.start()

    def start(self) -> _Started:
        transport = self.config.draft_transport
        if transport in CONNECTABLE_TRANSPORTS:
            link = {"kind": "listen", "transport": transport, "host": "127.0.0.1"}
            return _Started(self._popen(stdout=subprocess.PIPE), link)
        if transport == "gloo":
            store_dir = tempfile.mkdtemp(prefix="ssd-pair-")
            return _Started(self._popen(), {"kind": "gloo", "store_dir": store_dir}, store_dir=store_dir)
        from ssd.transport.shm_channel import Mailbox

        to_draft, to_target = Mailbox.create(), Mailbox.create()
        link = {
            "kind": "shm", "inbox": asdict(to_draft.handle), "outbox": asdict(to_target.handle),
            "parent_pid": os.getpid(), "spin_s": self.config.draft_spin_ms / 1000,
        }  # fmt: skip
        try:
            process = self._popen(pass_fds=to_draft.handle.fds() + to_target.handle.fds())
        except BaseException:
            to_draft.close()
            to_target.close()
            raise
        return _Started(process, link, boxes=(to_draft, to_target))

    def _popen(self, **popen) -> subprocess.Popen:
        command = [sys.executable, "-m", self.worker_module]
        args = {"stdin": subprocess.PIPE, "env": worker_env(), "close_fds": True, **popen}
        return self._thread.submit(subprocess.Popen, command, **args).result()

    def close(self) -> None:
        """Kill the prestarted processes nobody took; start no more."""
        waiting, self._waiting = self._waiting, []
        for started in waiting:
            started.discard()
        self._thread.shutdown(wait=False)


class SpawnedWorkers:
    """`WorkerProvider` of worker processes that this process starts: each acquire() takes one
    from the starter (prestarted, or started then) and gives it its spec, discard() stops it
    (kills it when it failed). A pool over this provider restarts a dead worker by acquiring a
    new one. starter: the WorkerStarter to take processes from (one of its own by default);
    this provider closes it."""

    def __init__(
        self, config: EngineConfig, vocab: int, worker_module: str, starter: WorkerStarter | None = None
    ) -> None:
        self.config, self.vocab = config, vocab
        self.fp = config_fingerprint(config, vocab)
        self.starter = starter or WorkerStarter(config, worker_module)

    def acquire(self) -> WorkerLink:
        started = self.starter.take()
        try:
            self._write_spec(started)
            if self.config.draft_transport in CONNECTABLE_TRANSPORTS:
                return self._listening(started)
            return self._paired(started)
        except BaseException:
            started.discard()
            raise

    def discard(self, link: WorkerLink, failed: bool) -> None:
        link.kill() if failed else link.close()

    def cancel(self) -> None:
        """Nothing waits here but a starting worker, which the pool discards once it is up."""

    def close(self) -> None:
        self.starter.close()

    def _write_spec(self, started: _Started) -> None:
        spec = {
            "config": asdict(self.config),
            "vocab": self.vocab,
            "log_level": logging.getLogger("ssd").getEffectiveLevel(),
            "link": started.link,
        }
        try:
            started.process.stdin.write(json.dumps(spec).encode())
            started.process.stdin.close()
        except BrokenPipeError as err:  # a prestarted process that died while it waited
            code = started.process.wait(5)
            raise DrafterUnavailable(f"draft worker exited with code {code} before it got its spec") from err

    def _paired(self, started: _Started) -> WorkerLink:
        """A worker over a channel of its own (shm mailboxes or a gloo pair), once it is READY."""
        from ssd.transport.shm_channel import ShmChannel

        process = started.process
        if started.boxes:
            to_draft, to_target = started.boxes
            channel = ShmChannel(to_target, to_draft, self.fp, lambda: process.poll() is None)
        else:
            channel = self._gloo(started.store_dir, process)
        try:
            await_ready(channel, f"draft worker pid {process.pid}", CONNECT_TIMEOUT)
        except ChannelClosed as err:
            raise DrafterUnavailable(f"draft worker exited with code {process.poll()} before it was ready") from err
        # The worker holds its own copies of the mailbox descriptors; the mappings stay ours.
        logger.info("draft worker pid %d ready (%s channel)", process.pid, self.config.draft_transport)
        store_dir = started.store_dir
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

    def _listening(self, started: _Started) -> WorkerLink:
        """A worker process that listens on a port of its own choosing (torch or grpc), reached
        through that transport as a remote worker would be; it prints its address when ready."""
        process = started.process
        line = process.stdout.readline()  # the model loads first; EOF if the worker died
        if not line:
            raise DrafterUnavailable(f"draft worker exited with code {process.wait(5)} before listening")
        address = json.loads(line)["address"]
        return WorkerLink.connect(
            address, self.fp, self.config.draft_deadline_s, f"pid {process.pid} at {address}",
            self.config.draft_device, process=process,
        )  # fmt: skip
