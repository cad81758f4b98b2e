"""The target's end of one draft worker: the draft protocol over one channel.

A `WorkerLink` is what a PoolClient holds per shard. It may own the worker's process (a worker
this process started: spawn.py) or only the connection (a worker that listens, started by Ray,
an operator or spawn.py for the torch and grpc transports).

Protocol safety: a reply is owed from each resolve() until reply() reads it (`owed`, the only
record of an outstanding outcome). If the caller never read it (an exception between the two,
e.g. Ctrl-C during a stop-string check), the next request first drains it, so a stale reply is
never mistaken for the answer to a later request.

Faults: errors, deadlines and broken channels become DrafterUnavailable (the pool replaces the
worker); the link is then closed and its process, if it owns one, killed.

Exit: a link is in `_OPEN` from its creation until it is killed (close() ends in kill()); one
atexit hook closes the links still open when the interpreter exits, so a worker this process
started does not outlive it. A closed link leaves nothing behind (no hook, no reference).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ssd.core.protocol import (
    AdmitMsg,
    BeginRoundMsg,
    DrafterUnavailable,
    GridMsg,
    JoinMsg,
    MsgType,
    NeuralBackupMsg,
    ReleaseMsg,
    ResolveMsg,
    SpeculationReply,
)
from ssd.transport.channel import Channel, ChannelTimeout
from ssd.transport.connect import connect_channel
from ssd.transport.shm_board import BoardReader
from ssd.transport.shm_feed import ALL, FeedPort
from ssd.transport.wire import Encoded, WireCounts, framed

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT = datetime.timedelta(seconds=180)
# How long a clean close waits for the worker to take its SHUTDOWN (not the reply deadline): a
# worker that does not take it in this time is cut off (kill()), which ends its session as well.
# A served target replica closed while its leased worker stopped reading (its pool being deleted
# beside it) waited the whole 30 s deadline and was force-killed by Serve at its grace period.
SHUTDOWN_TIMEOUT = datetime.timedelta(seconds=2)

# The links not killed yet, in creation order (id -> link): links are made and ended on several
# threads (a pool's refills acquire theirs in background threads), hence the lock.
_OPEN: dict[int, WorkerLink] = {}
_OPEN_LOCK = threading.Lock()


def open_links() -> list[WorkerLink]:
    """The links not closed or killed yet, oldest first."""
    with _OPEN_LOCK:
        return list(_OPEN.values())


@atexit.register
def _close_open_links() -> None:
    """At exit: close every link still open, the newest first (as one hook per link did)."""
    for link in reversed(open_links()):
        link.close()


def await_ready(channel: Channel, what: str, timeout: datetime.timedelta = CONNECT_TIMEOUT) -> None:
    """Wait for the worker's READY; DrafterUnavailable with its error when it sends ERROR."""
    kind, msg = channel.recv(timeout)
    if kind == MsgType.ERROR:
        raise DrafterUnavailable(f"{what} failed to start: {msg.text}")
    if kind != MsgType.READY:
        raise DrafterUnavailable(f"{what} sent {kind.name} instead of READY")


def announce(links: dict[int, WorkerLink], kind: MsgType, msg: Encoded, outcome: ResolveMsg | None) -> tuple[int, dict]:
    """Send `msg` to every link of `links` (shard -> link; all read one feed, shm_feed.py) in one
    write to their feed, instead of one write each. outcome: the RESOLVE that msg encodes (each
    shard it names owes a reply), None for another message. -> (frame bytes written, shard ->
    DrafterUnavailable of each link that failed: it is killed, as any failed link is)."""
    failed: dict[int, DrafterUnavailable] = {}
    for w, link in links.items():  # a reply still owed first, as every send does (_send)
        if link.owed is not None or link.closed:
            try:
                link._guard(link._drain_owed)
            except DrafterUnavailable as err:
                failed[w] = err
    live = {w: link for w, link in links.items() if w not in failed}
    if not live:
        return 0, failed
    first = next(iter(live.values()))
    data = framed(kind, msg, first.channel.fp)
    first.feed.writer.write(data, ALL, first.deadline)
    for w, link in live.items():
        if link.feed.lost is None:
            link.owed = outcome if outcome is not None and outcome.owes_reply(w) else None
            continue
        try:
            link._guard(link._dropped)
        except DrafterUnavailable as err:
            failed[w] = err
    return data.numel(), failed


class WorkerLink:
    """The draft protocol to one worker over `channel`. process: the worker's process when this
    process started it (killed with the link), else None; exits_on_shutdown: SHUTDOWN ends the
    worker (a listening worker waits for its next target instead); cleanup: called once the
    link is closed (a private rendezvous directory, say)."""

    def __init__(
        self,
        channel: Channel,
        name: str,
        deadline_s: float,
        process: subprocess.Popen | None = None,
        exits_on_shutdown: bool = True,
        cleanup: Callable[[], None] | None = None,
        board: BoardReader | None = None,
        feed: FeedPort | None = None,
    ) -> None:
        self.channel, self.name, self.process = channel, name, process
        self.board = board  # where its worker publishes its tree's depths (shm_board.py), if anywhere
        self.feed = feed  # its reader's port on its pool's feed (shm_feed.py), where the channel writes to it
        self.deadline = datetime.timedelta(seconds=deadline_s)
        self.exits_on_shutdown = exits_on_shutdown
        self._cleanup = cleanup
        self.closed = False
        self.rejected = 0  # stale or duplicated replies read and dropped
        self.owed: ResolveMsg | None = None  # the outcome sent whose reply was not read yet
        with _OPEN_LOCK:
            _OPEN[id(self)] = self

    @classmethod
    def connect(
        cls, address: str, fp: int, deadline_s: float, name: str = "", device: str = "cpu", process=None
    ) -> WorkerLink:
        """A link to the worker listening at `address` (torch:// or grpc://), once it is READY."""
        try:
            channel = connect_channel(address, fp, CONNECT_TIMEOUT, device)
        except (RuntimeError, OSError) as err:
            raise DrafterUnavailable(f"cannot reach the draft worker at {address}: {err}") from err
        try:
            await_ready(channel, f"the draft worker at {address}")
        except RuntimeError as err:  # DrafterUnavailable, or the channel broke
            channel.close()
            raise DrafterUnavailable(f"the draft worker at {address} did not become ready: {err}") from err
        return cls(channel, name or address, deadline_s, process, exits_on_shutdown=False)

    @property
    def wire(self) -> WireCounts:
        return self.channel.counts

    def is_alive(self) -> bool:
        return not self.closed and (self.process is None or self.process.poll() is None)

    # ---- the protocol ---------------------------------------------------------------------------

    def join(self, msg: JoinMsg) -> None:
        """Which shard of the branch grid this worker builds (before any sequence is admitted)."""
        self._guard(lambda: self._send(MsgType.JOIN, msg))

    def admit(self, msg: AdmitMsg) -> None:
        self._guard(lambda: self._send(MsgType.ADMIT, msg))

    def release(self, msg: ReleaseMsg) -> None:
        self._guard(lambda: self._send(MsgType.RELEASE, msg))

    def begin_round(self, msg: BeginRoundMsg, encoded: Encoded | None = None) -> None:
        """encoded: msg as wire.Encoded (a pool encodes a round once for all its workers)."""
        self._guard(lambda: self._send(MsgType.BEGIN_ROUND, encoded or msg))

    def predict(self, msg: BeginRoundMsg) -> None:
        """The round the target expects to announce next: the worker may begin it now."""
        self._guard(lambda: self._send(MsgType.PREDICT, msg))

    def resolve(self, msg: ResolveMsg, answers: bool = True, encoded: Encoded | None = None) -> None:
        """Send the round's outcome (encoded: as wire.Encoded, as for begin_round); answers: the
        worker replies to it (in a pool that names the answering shard of each row, only those
        with a row do)."""

        def send() -> None:
            self._send(MsgType.RESOLVE, encoded or msg)
            self.owed = msg if answers else None

        self._guard(send)

    def _dropped(self) -> None:
        """Its pool's feed dropped this worker's reader while writing to all (announce())."""
        raise ChannelTimeout(f"dropped from its pool's feed: {self.feed.lost}")

    def expect(self) -> None:
        """Let the worker send unasked (its round's GRID): post the receive of its next message
        where the transport needs one for the send to complete (Channel.poll)."""
        self._guard(self.channel.poll)

    def grid(self, round_id: int, seq_ids: list[int]) -> GridMsg:
        """The branch grid of round `round_id`, waiting for it up to the link's deadline (it left
        the worker when the round had forked, so it is usually in); a grid of an earlier round
        still in the channel, or a duplicated reply, is dropped."""

        def read() -> GridMsg:
            self._drain_owed()
            end = time.monotonic() + self.deadline.total_seconds()
            while True:
                left = datetime.timedelta(seconds=max(end - time.monotonic(), 0.0))
                kind, msg = self.channel.recv(left)
                if kind == MsgType.ERROR:
                    raise DrafterUnavailable(f"draft worker error: {msg.text}")
                if kind in (MsgType.REPLY, MsgType.NEURAL_BACKUP_REPLY) and msg.round_id <= round_id:
                    self.rejected += 1  # a duplicate, or the answer to a request given up on
                    continue
                if kind != MsgType.GRID or msg.round_id > round_id:
                    raise DrafterUnavailable(f"out-of-protocol {kind.name} while awaiting the grid of round {round_id}")
                if msg.round_id == round_id:
                    if msg.seq_ids != list(seq_ids):
                        raise DrafterUnavailable(f"the grid of round {round_id} is of another batch")
                    return msg

        return self._guard(read)

    def reply(self, deadline_s: float) -> SpeculationReply:
        """The answer to the outcome resolve() sent last."""

        def read() -> SpeculationReply:
            owed, self.owed = self.owed, None
            assert owed is not None, "reply() without its resolve()"
            return self._read_reply(owed.round_id, owed.seq_ids, deadline_s)

        return self._guard(read)

    def neural_backup(self, msg: NeuralBackupMsg) -> SpeculationReply:
        def request() -> SpeculationReply:
            self._send(MsgType.NEURAL_BACKUP, msg)
            return self._read_reply(
                msg.round_id, msg.seq_ids, self.deadline.total_seconds(), MsgType.NEURAL_BACKUP_REPLY
            )

        return self._guard(request)

    # ---- plumbing -------------------------------------------------------------------------------

    def _guard(self, fn):
        if self.closed:
            raise DrafterUnavailable(f"draft worker {self.name} was closed")
        try:
            return fn()
        except DrafterUnavailable:
            self.kill()
            raise
        except RuntimeError as err:  # peer gone, deadline passed, foreign frame
            self.kill()
            state = "stalled" if self.process is None or self.process.poll() is None else "exited"
            raise DrafterUnavailable(f"draft worker {self.name} {state}: {err}") from err
        except BaseException:
            # Interrupted mid-message (Ctrl-C inside a send or receive): the stream's position is
            # unknown, so nothing more can be read from this channel.
            self.kill()
            raise

    def _send(self, kind: MsgType, msg) -> None:
        """Send a request, after draining a reply still owed."""
        self._drain_owed()
        self.channel.send(kind, msg, self.deadline)

    def _drain_owed(self, deadline: datetime.timedelta | None = None) -> None:
        """Read and drop a reply still owed for an earlier outcome (waiting at most `deadline`,
        by default the link's)."""
        if self.owed is not None:
            owed, self.owed = self.owed, None
            self._read_reply(owed.round_id, owed.seq_ids, (deadline or self.deadline).total_seconds())
            logger.info("dropped the unread reply to round %d", owed.round_id)

    def _read_reply(
        self, round_id: int, seq_ids: list[int], deadline_s: float | None, expect: MsgType = MsgType.REPLY
    ) -> SpeculationReply:
        """The `expect` reply (REPLY to a resolve, NEURAL_BACKUP_REPLY to a neural_backup) of
        `round_id`. A reply to an earlier round or to the other request (a duplicate, or one a lost
        request left behind) is counted and dropped; anything else out of order is a broken worker
        (DrafterUnavailable)."""
        end = None if deadline_s is None else time.monotonic() + deadline_s
        replies = (MsgType.REPLY, MsgType.NEURAL_BACKUP_REPLY)
        while True:
            left = None if end is None else datetime.timedelta(seconds=max(end - time.monotonic(), 0.0))
            kind, reply = self.channel.recv(left)
            if kind == MsgType.ERROR:
                raise DrafterUnavailable(f"draft worker error: {reply.text}")
            if kind == MsgType.GRID:  # came after its round's outcome had gone out: of no use now
                continue
            if kind in replies and (reply.round_id < round_id or (kind != expect and reply.round_id == round_id)):
                self.rejected += 1
                logger.warning(
                    "dropped a stale %s of round %d while waiting for the %s of round %d",
                    kind.name, reply.round_id, expect.name, round_id,
                )  # fmt: skip
                continue
            if kind != expect or reply.round_id != round_id or reply.seq_ids != list(seq_ids):
                raise DrafterUnavailable(f"out-of-protocol reply {kind.name} for round {round_id}")
            return reply

    # ---- lifetime -------------------------------------------------------------------------------

    def kill(self) -> None:
        """End the link now: kill the process it owns, close the channel."""
        self.closed = True
        with _OPEN_LOCK:
            _OPEN.pop(id(self), None)
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                logger.error("draft worker pid %d did not exit after SIGKILL", self.process.pid)
        self.channel.close(peer_exited=self.process is not None and self.process.poll() is not None)
        cleanup, self._cleanup = self._cleanup, None
        if cleanup is not None:
            cleanup()
        board, self.board = self.board, None
        if board is not None:
            board.close()

    def close(self) -> None:
        """End the session cleanly: drain an owed reply, SHUTDOWN, wait for an owned process."""
        if self.closed:
            return
        try:
            # A worker that owes a reply and stopped answering gets the same bound as its SHUTDOWN.
            self._drain_owed(min(self.deadline, SHUTDOWN_TIMEOUT))
            self.channel.send(MsgType.SHUTDOWN, None, min(self.deadline, SHUTDOWN_TIMEOUT))
            if self.exits_on_shutdown and self.process is not None:
                self.process.wait(10)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            logger.warning("draft worker did not take the shutdown message: %s", err)
        self.kill()


class WorkerProvider(Protocol):
    """Where a PoolClient gets its workers."""

    def acquire(self) -> WorkerLink:
        """A ready worker (blocks while one starts or is leased); DrafterUnavailable if none can be had."""

    def discard(self, link: WorkerLink, failed: bool) -> None:
        """Give a worker back: closed or killed, its lease released (and, if failed, reported)."""

    def cancel(self) -> None:
        """The pool is closing: an acquire() that waits for a worker to become free gives up at
        once (DrafterUnavailable); one whose worker is already starting may finish."""

    def close(self) -> None: ...
