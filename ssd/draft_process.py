"""The drafter in its own process, reached over shared memory or a torch.distributed pair group.

draft_channel="shm" (the default) uses the shared-memory mailboxes of ssd/shm_channel.py: the
lowest latency on one host. draft_channel="gloo" uses a pair group, the layout a drafter on
another host would use (on GPUs the same layout would travel over NCCL). The pair group is
stateless: created from a private FileStore (no port to choose, none fixed) with
ProcessGroupGloo on loopback, never the default group, so several pairs can live in one process.

The worker begins the next round as soon as it has replied with a hit for every row
(_build_predicted): the target's announcement of that round follows about a millisecond later,
after the target's bookkeeping, and confirms it (or the round is taken back).

Lifetime: the worker asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG), the
client shuts it down on close() or interpreter exit, and kills it if it will not go. A worker
that fails sends an ERROR message before exiting; the client turns errors, deadlines and broken
pipes into DrafterUnavailable, which the SSD proposer answers by going on alone.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from ssd.channel import DrafterUnavailable
from ssd.config import EngineConfig
from ssd.messages import AdmitMsg, BeginRoundMsg, DraftNowMsg, ReleaseMsg, ResolveMsg, SpeculationReply
from ssd.shm_channel import ChannelClosed, Mailbox, ShmEndpoint
from ssd.wire import HEADER, MsgType, body_size, encode, fingerprint, frame, unframe

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = datetime.timedelta(seconds=180)
# The group's own timeout bounds every blocking op without an explicit deadline (the worker's
# wait for the next message between requests can be long).
GROUP_TIMEOUT = datetime.timedelta(days=7)
_TAG = 0


_JOINING = "worker-joining"


def pair_store(store_dir: str) -> dist.FileStore:
    store = dist.FileStore(os.path.join(store_dir, "store"), 2)
    store.set_timeout(CONNECT_TIMEOUT)
    return store


def pair_group(store: dist.Store, rank: int) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = GROUP_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, 2, opts)


class _Endpoint:
    """Typed send/recv over a pair group; peer = the other rank."""

    def __init__(self, group: dist.ProcessGroup, peer: int, fp: int) -> None:
        self.group, self.peer, self.fp = group, peer, fp

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

    def post_header(self) -> "_Posted":
        """Post the receive of the next message's header without waiting for it."""
        return _Posted(self.group, self.peer)

    def recv(self, timeout: datetime.timedelta | None = None, posted: "_Posted | None" = None):
        """-> (MsgType, message or None for bodiless control messages, ints)"""
        if posted is not None:
            header = posted.wait()
        else:
            header = torch.zeros(HEADER, dtype=torch.long)
            self._recv(header, timeout)
        body = torch.zeros(body_size(header, self.fp), dtype=torch.uint8)
        if body.numel():
            self._recv(body, timeout)
        return unframe(header, body)

    def _recv(self, t: torch.Tensor, timeout: datetime.timedelta | None) -> None:
        work = self.group.recv([t], self.peer, _TAG)
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)


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

    def wait(self) -> torch.Tensor:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self.header


def _config_fingerprint(config: EngineConfig, vocab: int) -> int:
    return fingerprint(vocab, config.k, config.draft, config.draft_dtype, config.saguaro_c)


class ProcessClient:
    """DraftClient whose drafter runs in a child process (rank 1 of a private pair group)."""

    def __init__(self, process, endpoint, store_dir: str | None, deadline_s: float) -> None:
        self.process, self.endpoint, self.store_dir = process, endpoint, store_dir
        self.deadline = datetime.timedelta(seconds=deadline_s)
        self.closed = False
        atexit.register(self.close)

    @classmethod
    def spawn(cls, config: EngineConfig, vocab: int) -> "ProcessClient":
        ctx = mp.get_context("spawn")
        fp = _config_fingerprint(config, vocab)
        store_dir = None
        if config.draft_channel == "shm":
            to_draft, to_target = Mailbox(ctx), Mailbox(ctx)
            link = ("shm", to_draft, to_target)
        else:
            store_dir = tempfile.mkdtemp(prefix="ssd-pair-")
            link = ("gloo", store_dir)
        process = ctx.Process(target=worker_main, args=(asdict(config), vocab, link), daemon=True, name="ssd-drafter")
        process.start()
        try:
            if store_dir is None:
                endpoint = ShmEndpoint(to_target, to_draft, fp, process.is_alive)
            else:
                store = pair_store(store_dir)
                _await_worker(store, process)
                endpoint = _Endpoint(pair_group(store, 0), 1, fp)
            try:
                kind, _, ints = endpoint.recv(CONNECT_TIMEOUT)
            except ChannelClosed as err:
                raise DrafterUnavailable(f"draft worker exited with code {process.exitcode} before it was ready") from err
            if kind != MsgType.READY:
                raise DrafterUnavailable(f"draft worker failed to start: {_text(ints)}")
        except BaseException:
            process.kill()
            process.join(5)
            if store_dir is not None:
                shutil.rmtree(store_dir, ignore_errors=True)
            raise
        logger.info("draft worker pid %d ready (%s channel)", process.pid, config.draft_channel)
        return cls(process, endpoint, store_dir, config.draft_deadline_s)

    def _guard(self, fn):
        if self.closed:
            raise DrafterUnavailable("draft worker was closed")
        try:
            return fn()
        except DrafterUnavailable:
            self._kill()
            raise
        except RuntimeError as err:  # gloo: peer gone, read error, deadline passed
            self._kill()
            alive = "exited with code %s" % self.process.exitcode if not self.process.is_alive() else "stalled"
            raise DrafterUnavailable(f"draft worker {alive}: {err}") from err

    def _request(self, msg, deadline_s: float | None) -> SpeculationReply:
        self.endpoint.send(msg, self.deadline)
        return self._reply(msg, deadline_s)

    def _reply(self, msg, deadline_s: float | None) -> SpeculationReply:
        timeout = datetime.timedelta(seconds=deadline_s) if deadline_s is not None else None
        kind, reply, ints = self.endpoint.recv(timeout)
        if kind == MsgType.ERROR:
            raise DrafterUnavailable(f"draft worker error: {_text(ints)}")
        if kind != MsgType.REPLY or reply.round_id != msg.round_id or reply.seq_ids != list(msg.seq_ids):
            raise DrafterUnavailable(f"out-of-protocol reply {kind.name} for round {msg.round_id}")
        return reply

    def admit(self, msg: AdmitMsg) -> None:
        self._guard(lambda: self.endpoint.send(msg, self.deadline))

    def release(self, msg: ReleaseMsg) -> None:
        self._guard(lambda: self.endpoint.send(msg, self.deadline))

    def begin_round(self, msg: BeginRoundMsg) -> None:
        self._guard(lambda: self.endpoint.send(msg, self.deadline))

    def resolve(self, msg: ResolveMsg) -> None:
        self._guard(lambda: self.endpoint.send(msg, self.deadline))

    def reply(self, msg: ResolveMsg, deadline_s: float) -> SpeculationReply:
        return self._guard(lambda: self._reply(msg, deadline_s))

    def draft_now(self, msg: DraftNowMsg) -> SpeculationReply:
        return self._guard(lambda: self._request(msg, self.deadline.total_seconds()))

    def _kill(self) -> None:
        self.closed = True
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.endpoint.send_raw(MsgType.SHUTDOWN, 0, torch.zeros(0, dtype=torch.long), torch.zeros(0), self.deadline)
            self.process.join(10)
        except RuntimeError as err:
            logger.warning("draft worker did not take the shutdown message: %s", err)
        self._kill()


def _await_worker(store: dist.Store, process) -> None:
    """Wait until the child announces that it is joining the pair group. A child that dies on
    the way (a failed import, a killed interpreter) is reported at once instead of after the
    group's connect timeout."""
    deadline = time.monotonic() + CONNECT_TIMEOUT.total_seconds()
    while not store.check([_JOINING]):
        if not process.is_alive():
            raise DrafterUnavailable(f"draft worker exited with code {process.exitcode} before connecting")
        if time.monotonic() > deadline:
            raise DrafterUnavailable(f"draft worker did not connect within {CONNECT_TIMEOUT.total_seconds():.0f} s")
        time.sleep(0.02)


def _text(ints: torch.Tensor) -> str:
    return bytes(ints.tolist()).decode("utf-8", errors="replace")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        logger.warning("PR_SET_PDEATHSIG unavailable: the draft worker may outlive a killed parent")


class _NextRound:
    """Reads the channel while the drafter builds a round it predicted: the target's
    announcement confirms the round when it matches (then the outcome's arrival cuts the tree
    as usual); anything else makes the round stale and is kept for the worker to handle."""

    def __init__(self, endpoint, predicted: BeginRoundMsg) -> None:
        self.endpoint, self.predicted = endpoint, predicted
        self.posted = endpoint.post_header()
        self.confirmed = False
        self.other: tuple | None = None  # (kind, message) that superseded the prediction

    def _read(self, block: bool) -> None:
        if self.confirmed or self.other is not None or not (block or self.posted.arrived()):
            return
        kind, msg, _ = self.endpoint.recv(posted=self.posted)
        if kind == MsgType.BEGIN_ROUND and msg.same_round(self.predicted):
            self.confirmed = True
            self.posted = self.endpoint.post_header()
        else:
            self.other = (kind, msg)

    def stale(self) -> bool:
        self._read(block=False)
        return self.other is not None

    def outcome_arrived(self) -> bool:
        self._read(block=False)
        return self.confirmed and self.posted.arrived()

    def settle(self) -> None:
        """After the build: wait for the announcement if it has not come yet."""
        self._read(block=True)


def _build_predicted(drafter, endpoint, predicted: BeginRoundMsg):
    """Build the round predicted after an all-hit reply while the target is still finishing
    its step (bookkeeping, the next proposal, the announcement): about a millisecond more for
    the tree each round. The announcement confirms it, or the round is taken back (cache and
    generators as before, so outputs do not depend on the prediction) and the message that
    came instead is handled as usual. -> (posted header of the next message, or None;
    a message to handle first, or None)."""
    watch = _NextRound(endpoint, predicted)
    built = drafter.begin_round(predicted, interrupted=watch.outcome_arrived, stale=watch.stale)
    watch.settle()
    if watch.other is None:
        return watch.posted, None
    if built:
        drafter.abandon_round()
    return None, watch.other


def worker_main(config: dict, vocab: int, link: tuple) -> None:
    """Entry point of the draft process: load the draft, then serve messages until SHUTDOWN.
    `link` is ("shm", inbox, outbox) or ("gloo", store_dir)."""
    _die_with_parent()
    parent = os.getppid()
    cfg = EngineConfig(**config)
    torch.set_num_threads(cfg.draft_num_threads)
    from ssd.drafter import Drafter
    from ssd.loader import load_model
    from ssd.runner import draft_runner

    fp = _config_fingerprint(cfg, vocab)
    if link[0] == "shm":
        endpoint = ShmEndpoint(link[1], link[2], fp, lambda: os.getppid() == parent)
    else:
        store = pair_store(link[1])
        store.set(_JOINING, str(os.getpid()))
        endpoint = _Endpoint(pair_group(store, 1), 0, fp)
    try:
        model = load_model(cfg.draft, cfg.draft_dtype, cfg.draft_device, cfg.trust_remote_code)
        drafter = Drafter(draft_runner(model, cfg.draft_device, cfg.lean_forward), vocab, cfg.k, cfg.saguaro_c)
        endpoint.send_raw(MsgType.READY, 0, torch.zeros(0, dtype=torch.long), torch.zeros(0))
        posted = None
        queued = None  # a message read while building a predicted round that it superseded
        while True:
            if queued is not None:
                (kind, msg), queued = queued, None
            else:
                kind, msg, _ = endpoint.recv(posted=posted)
            posted = None
            if kind == MsgType.SHUTDOWN:
                return
            if kind == MsgType.ADMIT:
                drafter.admit(msg)
            elif kind == MsgType.RELEASE:
                drafter.release(msg.seq_ids)
            elif kind == MsgType.BEGIN_ROUND:
                # The next message (the round's outcome) cuts the tree decode short: the target
                # is waiting, and branches of the depth reached are still usable speculations.
                posted = endpoint.post_header()
                drafter.begin_round(msg, interrupted=posted.arrived)
            elif kind == MsgType.RESOLVE:
                reply = drafter.resolve(msg)
                endpoint.send(reply)
                predicted = drafter.predict_round(msg, reply)
                if predicted is not None:
                    posted, queued = _build_predicted(drafter, endpoint, predicted)
            elif kind == MsgType.DRAFT_NOW:
                endpoint.send(drafter.draft_reply(msg))
            else:
                raise ValueError(f"draft worker got unexpected {kind.name}")
    except Exception as err:
        logging.getLogger(__name__).exception("draft worker failed")
        text = torch.tensor(list(f"{type(err).__name__}: {err}".encode()[:4000]), dtype=torch.long)
        try:
            endpoint.send_raw(MsgType.ERROR, 0, text, torch.zeros(0))
        except RuntimeError as send_err:
            logging.getLogger(__name__).error("could not report the failure to the target: %s", send_err)
        raise SystemExit(1) from err
