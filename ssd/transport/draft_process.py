"""The target's side of a drafter in its own process: start it, talk to it, stop it.

`ProcessClient.spawn` starts `python -m ssd.transport.draft_worker` (the package's own entry point, so the
caller's main module is never re-imported: stdin scripts, `python -c`, notebooks, scripts
without a `__main__` guard and Ray actors all work), hands it its spec on stdin and waits for
READY. draft_transport="shm" (the default) passes it the file descriptors of two shared-memory
mailboxes (ssd/transport/shm_channel.py): the lowest latency on one host. draft_transport="gloo" gives it a
private FileStore directory for a torch.distributed pair group (ssd/transport/gloo_channel.py).

Protocol safety: a reply is owed from each resolve() until reply() reads it. If the caller
never read it (an exception between the two, e.g. Ctrl-C during a stop-string check), the next
request first drains it, so a stale reply is never mistaken for the answer to a later request.

Lifetime: the worker asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG), the
client shuts it down on close() or interpreter exit, and kills it if it will not go. A worker
that fails sends an ERROR message before exiting; the client turns errors, deadlines and broken
channels into DrafterUnavailable, which the SSD proposer answers by going on alone.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from ssd.config import EngineConfig
from ssd.transport.channel import Channel, ChannelClosed, DrafterUnavailable
from ssd.transport.draft_worker import config_fingerprint
from ssd.transport.messages import (
    AdmitMsg,
    BeginRoundMsg,
    DraftNowMsg,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)
from ssd.transport.wire import MsgType, WireCounts, encode

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = datetime.timedelta(seconds=180)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding ssd/ (this is ssd/transport/)


def worker_command() -> list[str]:
    return [sys.executable, "-m", "ssd.transport.draft_worker"]


def worker_env() -> dict[str, str]:
    """The worker imports this very package, wherever the caller found it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    return env


class ProcessClient:
    """DraftClient whose drafter runs in a child process (one link of a DraftPool)."""

    def __init__(self, process: subprocess.Popen, channel: Channel, store_dir: str | None, deadline_s: float) -> None:
        self.process, self.channel, self.store_dir = process, channel, store_dir
        self.deadline = datetime.timedelta(seconds=deadline_s)
        self.closed = False
        self.exits_on_shutdown = True  # SHUTDOWN ends the worker (a listening worker waits for its next target)
        self.name = f"pid {process.pid}"
        self.rejected = 0  # stale or duplicated replies read and dropped
        self._owed: ResolveMsg | None = None  # an outcome sent whose reply was not read yet
        atexit.register(self.close)

    @classmethod
    def spawn(cls, config: EngineConfig, vocab: int, popen=subprocess.Popen) -> "ProcessClient":
        """Start a worker and wait until it is READY. `popen` starts the process: the worker dies
        with the *thread* that started it (PR_SET_PDEATHSIG follows the creating thread), so a
        caller in a short-lived thread passes one that starts it from a long-lived thread."""
        fp = config_fingerprint(config, vocab)
        spec = {"config": asdict(config), "vocab": vocab, "log_level": logging.getLogger("ssd").getEffectiveLevel()}
        store_dir, fds, boxes = None, (), ()
        if config.draft_transport == "shm":
            from ssd.transport.shm_channel import Mailbox, ShmChannel

            boxes = to_draft, to_target = Mailbox.create(), Mailbox.create()
            spec["link"] = {
                "kind": "shm",
                "inbox": asdict(to_draft.handle),
                "outbox": asdict(to_target.handle),
                "parent_pid": os.getpid(),
                "spin_s": config.draft_spin_ms / 1000,
            }
            fds = to_draft.handle.fds() + to_target.handle.fds()
        else:
            store_dir = tempfile.mkdtemp(prefix="ssd-pair-")
            spec["link"] = {"kind": "gloo", "store_dir": store_dir}
        process = popen(worker_command(), stdin=subprocess.PIPE, env=worker_env(), pass_fds=fds, close_fds=True)
        try:
            process.stdin.write(json.dumps(spec).encode())
            process.stdin.close()
            alive = lambda: process.poll() is None  # noqa: E731
            if store_dir is None:
                channel = ShmChannel(to_target, to_draft, fp, alive)
            else:
                from ssd.transport.gloo_channel import (
                    GlooChannel,
                    WorkerGone,
                    await_worker,
                    pair_group,
                    pair_store,
                )

                store = pair_store(store_dir)
                try:
                    await_worker(store, alive, process.poll)
                except WorkerGone as err:
                    raise DrafterUnavailable(str(err)) from err
                channel = GlooChannel(pair_group(store, 0), 1, fp)
            try:
                kind, _, ints = channel.recv(CONNECT_TIMEOUT)
            except ChannelClosed as err:
                raise DrafterUnavailable(f"draft worker exited with code {process.poll()} before it was ready") from err
            if kind != MsgType.READY:
                raise DrafterUnavailable(f"draft worker failed to start: {_text(ints)}")
        except BaseException:
            process.kill()
            process.wait(5)
            for box in boxes:
                box.close()
            if store_dir is not None:
                shutil.rmtree(store_dir, ignore_errors=True)
            raise
        # The worker holds its own copies of the mailbox descriptors; the mappings stay ours.
        logger.info("draft worker pid %d ready (%s channel)", process.pid, config.draft_transport)
        return cls(process, channel, store_dir, config.draft_deadline_s)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def wire(self) -> WireCounts:
        return self.channel.counts

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def _guard(self, fn):
        if self.closed:
            raise DrafterUnavailable("draft worker was closed")
        try:
            return fn()
        except DrafterUnavailable:
            self._kill()
            raise
        except RuntimeError as err:  # peer gone, deadline passed, foreign frame
            self._kill()
            alive = f"exited with code {self.process.poll()}" if not self.is_alive() else "stalled"
            raise DrafterUnavailable(f"draft worker {alive}: {err}") from err
        except BaseException:
            # Interrupted mid-message (Ctrl-C inside a send or receive): the stream's position is
            # unknown, so nothing more can be read from this channel.
            self._kill()
            raise

    def _read_reply(
        self, round_id: int, seq_ids: list[int], deadline_s: float | None, expect: MsgType = MsgType.REPLY
    ) -> SpeculationReply:
        """The `expect` reply (REPLY to a resolve, DRAFT_REPLY to a draft_now) of `round_id`. A
        reply to an earlier round or to the other request (a duplicate, or one a lost request
        left behind) is counted and dropped; anything else out of order is a broken worker
        (DrafterUnavailable)."""
        end = None if deadline_s is None else time.monotonic() + deadline_s
        while True:
            left = None if end is None else datetime.timedelta(seconds=max(end - time.monotonic(), 0.0))
            kind, reply, ints = self.channel.recv(left)
            if kind == MsgType.ERROR:
                raise DrafterUnavailable(f"draft worker error: {_text(ints)}")
            replies = (MsgType.REPLY, MsgType.DRAFT_REPLY)
            if kind in replies and (reply.round_id < round_id or (kind != expect and reply.round_id == round_id)):
                self.rejected += 1
                logger.warning(
                    "dropped a stale %s of round %d while waiting for the %s of round %d",
                    kind.name,
                    reply.round_id,
                    expect.name,
                    round_id,
                )
                continue
            if kind != expect or reply.round_id != round_id or reply.seq_ids != list(seq_ids):
                raise DrafterUnavailable(f"out-of-protocol reply {kind.name} for round {round_id}")
            return reply

    def _drain_owed(self) -> None:
        """Read and drop a reply still owed for an earlier outcome."""
        if self._owed is not None:
            owed, self._owed = self._owed, None
            self._read_reply(owed.round_id, owed.seq_ids, self.deadline.total_seconds())
            logger.info("dropped the unread reply to round %d", owed.round_id)

    def _send(self, msg) -> None:
        """Send a request, after draining a reply still owed."""
        self._drain_owed()
        self.channel.send(msg, self.deadline)

    def admit(self, msg: AdmitMsg) -> None:
        self._guard(lambda: self._send(msg))

    def release(self, msg: ReleaseMsg) -> None:
        self._guard(lambda: self._send(msg))

    def begin_round(self, msg: BeginRoundMsg) -> None:
        self._guard(lambda: self._send(msg))

    def predict(self, msg: BeginRoundMsg) -> None:
        """The round the target expects to announce next: the worker may begin it now."""
        _, round_id, ints, floats = encode(msg)
        self._guard(lambda: self._send_raw(MsgType.PREDICT, round_id, ints, floats))

    def join(self, shard: int, num_shards: int) -> None:
        """Which share of the branch grid this worker builds (before any sequence is admitted)."""
        self._guard(lambda: self._send_raw(MsgType.JOIN, 0, torch.tensor([shard, num_shards]), torch.zeros(0)))

    def _send_raw(self, kind: MsgType, round_id: int, ints: torch.Tensor, floats: torch.Tensor) -> None:
        self._drain_owed()
        self.channel.send_raw(kind, round_id, ints, floats, self.deadline)

    def resolve(self, msg: ResolveMsg) -> None:
        def send() -> None:
            self._send(msg)
            self._owed = msg

        self._guard(send)

    def reply(self, msg: ResolveMsg, deadline_s: float) -> SpeculationReply:
        def read() -> SpeculationReply:
            assert self._owed is not None and self._owed.round_id == msg.round_id, "reply() without its resolve()"
            self._owed = None
            return self._read_reply(msg.round_id, msg.seq_ids, deadline_s)

        return self._guard(read)

    def draft_now(self, msg: DraftNowMsg) -> SpeculationReply:
        def request() -> SpeculationReply:
            self._send(msg)
            return self._read_reply(msg.round_id, msg.seq_ids, self.deadline.total_seconds(), MsgType.DRAFT_REPLY)

        return self._guard(request)

    def kill(self) -> None:
        self._kill()

    def _kill(self) -> None:
        self.closed = True
        if self.is_alive():
            self.process.kill()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            logger.error("draft worker pid %d did not exit after SIGKILL", self.process.pid)
        self.channel.close()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self._owed is not None:
                owed, self._owed = self._owed, None
                self._read_reply(owed.round_id, owed.seq_ids, self.deadline.total_seconds())
            self.channel.send_raw(MsgType.SHUTDOWN, 0, torch.zeros(0, dtype=torch.long), torch.zeros(0), self.deadline)
            if self.exits_on_shutdown:
                self.process.wait(10)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            logger.warning("draft worker did not take the shutdown message: %s", err)
        self._kill()


class _NoProcess:
    """The process handle of a worker this process did not start (a remote worker, a Ray actor):
    its liveness is its channel's; killing it only drops the connection."""

    pid = -1

    def poll(self) -> None:
        return None

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int:
        return 0


def connect_channel(address: str, fp: int, timeout: datetime.timedelta, device: str = "cpu") -> Channel:
    """A channel to a listening worker at `address` ("torch://host:port" or "grpc://host:port")."""
    scheme = address.split("://", 1)[0]
    if scheme == "torch":
        from ssd.transport.torch_channel import connect_torch

        return connect_torch(address, fp, timeout, device)
    if scheme == "grpc":
        from ssd.transport.grpc_channel import connect_grpc

        return connect_grpc(address, fp, timeout)
    raise ValueError(f"draft worker address {address!r}: expected torch://host:port or grpc://host:port")


class RemoteClient(ProcessClient):
    """A WorkerLink to a worker that listens (started by Ray, by an operator, or by SpawnedWorkers
    for the torch and grpc transports): the same protocol, no process to manage."""

    @classmethod
    def connect(
        cls, address: str, fp: int, deadline_s: float, name: str = "", device: str = "cpu", process=None
    ) -> "RemoteClient":
        try:
            channel = connect_channel(address, fp, CONNECT_TIMEOUT, device)
        except (RuntimeError, OSError) as err:
            raise DrafterUnavailable(f"cannot reach the draft worker at {address}: {err}") from err
        try:
            kind, _, ints = channel.recv(CONNECT_TIMEOUT)
        except RuntimeError as err:
            channel.close()
            raise DrafterUnavailable(f"draft worker at {address} did not become ready: {err}") from err
        if kind != MsgType.READY:
            channel.close()
            raise DrafterUnavailable(f"draft worker at {address} refused the session: {_text(ints)}")
        client = cls(process or _NoProcess(), channel, None, deadline_s)
        client.name, client.exits_on_shutdown = name or address, False
        return client


class SpawnedWorkers:
    """`WorkerSource` (ssd/transport/pool.py) of worker processes that this process starts: each
    acquire() spawns one, discard() stops it (kills it when it failed). A pool over this source
    restarts a dead worker by acquiring a new one."""

    def __init__(self, config: EngineConfig, vocab: int) -> None:
        self.config, self.vocab = config, vocab
        # Every worker is started from this one thread, which lives as long as the source: a
        # worker started from a thread that then exits (a refill thread, a server's request
        # thread) would be killed by its parent-death signal at once.
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ssd-draft-starter")

    def _popen(self, *args, **kwargs) -> subprocess.Popen:
        return self._starter.submit(subprocess.Popen, *args, **kwargs).result()

    def acquire(self) -> ProcessClient:
        if self.config.draft_transport in ("torch", "grpc"):
            return self._spawn_listening()
        return ProcessClient.spawn(self.config, self.vocab, popen=self._popen)

    def _spawn_listening(self) -> RemoteClient:
        """A worker process that listens on a port of its own choosing (torch or grpc), reached
        through that transport as a remote worker would be; it prints its address when ready."""
        spec = {
            "config": asdict(self.config),
            "vocab": self.vocab,
            "log_level": logging.getLogger("ssd").getEffectiveLevel(),
            "link": {"kind": "listen", "transport": self.config.draft_transport, "host": "127.0.0.1"},
        }
        process = self._popen(
            worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=worker_env(), close_fds=True
        )
        try:
            process.stdin.write(json.dumps(spec).encode())
            process.stdin.close()
            line = process.stdout.readline()  # the model loads first; EOF if the worker died
            if not line:
                raise DrafterUnavailable(f"draft worker exited with code {process.wait(5)} before listening")
            address = json.loads(line)["address"]
            fp = config_fingerprint(self.config, self.vocab)
            return RemoteClient.connect(
                address,
                fp,
                self.config.draft_deadline_s,
                f"pid {process.pid} at {address}",
                self.config.draft_device,
                process=process,
            )
        except BaseException:
            process.kill()
            process.wait(5)
            raise

    def discard(self, link: ProcessClient, failed: bool) -> None:
        link.kill() if failed else link.close()

    def close(self) -> None:
        self._starter.shutdown(wait=False)


def _text(ints: torch.Tensor) -> str:
    return bytes(ints.tolist()).decode("utf-8", errors="replace")
