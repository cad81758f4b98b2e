"""The `torch` transport: a `Channel` over a torch.distributed pair group, and the listener a
target connects to (a draft worker on any host).

Design
- A channel is a 2-rank ProcessGroup of its own (never the default group: several pairs live in
  one process): gloo for device "cpu", NCCL for a CUDA device. Frames (ssd/transport/wire.py) go
  in two transfers, header then body; on NCCL they are copied to the device before sending and
  back to the CPU after receiving. The NCCL path is untested (written on a CPU-only machine);
  how soon NCCL reports a dead peer is unknown. Gloo's behaviour below is measured.
- Rendezvous: `TorchListener` runs a TCPStore server on a port the OS picks and publishes
  `torch://host:port`. A target (`connect_torch`) draws a session number, claims the worker by
  compare-and-set of the owner key (free -> its number), then both build the pair group over a
  PrefixStore unique to the session: target rank 0, worker rank 1. A second target finds the key
  taken and is refused at once (`WorkerBusy`). The key is freed as soon as either end's channel
  ends, so the next target may claim the worker before it is back in accept(): its handshake
  waits for it. A target that dies between claim and handshake costs the worker HANDSHAKE_TIMEOUT.

Invariants
- poll() never blocks: it posts the next message's receive and a helper thread completes it
  (header, then body), because gloo's Work.is_completed() does not track arrival (only wait()
  does). A peer may send unasked to an end that has polled: its send does not wait for recv().
- Any failure ends the session for both ends: a dead or closed peer surfaces as ChannelClosed
  within milliseconds (its sockets close: "Connection closed by peer"), a deadline as
  ChannelTimeout. Gloo closes the pair when a wait times out; we abort it on every other error
  too (helper-thread timeout, foreign frame): the stream position is then unknown, and a receive
  of the wrong size makes gloo terminate the process.
- close() aborts the pair even while a receive is posted (which keeps gloo's context and its
  sockets alive): a 1 ms receive on a tag the peer never sends on times out, and a timeout makes
  gloo close every pair of the context.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from ssd.core.protocol import MsgType
from ssd.transport.channel import ChannelClosed, ChannelTimeout, WorkerBusy
from ssd.transport.wire import HEADER, ForeignMessage, WireCounts, body_size, frame, unframe

logger = logging.getLogger(__name__)

# Every wait passes an explicit timeout (this one when the caller gives none): the group's own
# timeout is only the handshake's, because gloo's connect waits that long for a peer that died.
GROUP_TIMEOUT = datetime.timedelta(days=7)
# How long the worker gives a target that claimed it to join the pair group.
HANDSHAKE_TIMEOUT = datetime.timedelta(seconds=60)
# How long a target's store client may take to reach a worker whose port accepted a plain
# connection: a live listener answers at once, one whose process is going away resets every
# connection, and the store client retries those until its timeout (a lease of a worker that
# was just killed held a target's refill for minutes under the connect timeout of 180 s).
STORE_CONNECT_TIMEOUT = datetime.timedelta(seconds=5)
_TAG = 0  # every frame
_ABORT_TAG = 1  # never sent on: a receive on it can only time out (see _abort)
_ABORT_WAIT = datetime.timedelta(milliseconds=1)
_POLL_S = 0.01  # the listener's check for a claim
_OWNER, _SESSIONS, _BACKEND, _FREE = "owner", "sessions", "backend", "free"


def backend_for(device: torch.device | str) -> str:
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"torch transport: device {device!r} is neither cpu (gloo) nor cuda (NCCL)")
    return "gloo" if kind == "cpu" else "nccl"


def new_pair_group(
    store: dist.Store,
    rank: int,
    device: torch.device | str = "cpu",
    hostname: str = "127.0.0.1",
    connect_timeout: datetime.timedelta = HANDSHAKE_TIMEOUT,
) -> dist.ProcessGroup:
    """A 2-rank group over `store`; blocks until both ranks joined. hostname: the address this
    rank's gloo sockets bind to, one the peer can reach."""
    if backend_for(device) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = GROUP_TIMEOUT  # NCCL's watchdog tears down work pending longer than this
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    opts._timeout = connect_timeout
    return dist.ProcessGroupGloo(store, rank, 2, opts)


class _Posted:
    """A posted receive of the next message; arrived() says whether it is in, without waiting. A
    helper thread waits for its header (wait() releases the GIL), then receives its body, and sets
    an Event: so a peer's send completes while this end's own thread is busy (the grid a pool's
    worker sends unasked, ssd/transport/pool_client.py)."""

    def __init__(self, group: dist.ProcessGroup, peer: int, device: torch.device, fp: int) -> None:
        self.header = torch.zeros(HEADER, dtype=torch.long, device=device)
        self.body: torch.Tensor | None = None
        self.done = threading.Event()
        self.error: RuntimeError | None = None  # the pair broke, or a foreign frame (ForeignMessage)
        work = group.recv([self.header], peer, _TAG)
        args = (group, peer, work, device, fp)
        threading.Thread(target=self._receive, args=args, name="ssd-next-message", daemon=True).start()

    def _receive(self, group: dist.ProcessGroup, peer: int, work, device: torch.device, fp: int) -> None:
        # On a device, this thread's work (the body's receive, the waits) goes on a side stream, so
        # the default stream (the target's forwards) neither waits for it nor holds it up.
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        try:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                _wait(work, side)
                # Checked before the body's receive: one of the wrong size makes gloo end the process.
                body = torch.zeros(body_size(self.header.cpu(), fp), dtype=torch.uint8, device=device)
                if body.numel():
                    _wait(group.recv([body], peer, _TAG), side)
            self.body = body
        except RuntimeError as err:  # recv() reports it
            self.error = err
        finally:
            self.done.set()

    def arrived(self) -> bool:
        return self.done.is_set()


def _wait(work, side) -> None:
    """Wait for a transfer; side: the current (side) stream on a device, which NCCL's wait() only
    orders after the transfer, so it is synchronized for the bytes to be in."""
    work.wait(GROUP_TIMEOUT)
    if side is not None:
        side.synchronize()


class TorchChannel:
    """The `Channel` protocol (ssd/transport/channel.py) over a 2-rank group; peer = the other rank."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        peer: int,
        fp: int,
        device: torch.device | str = "cpu",
        on_end: Callable[[], None] | None = None,
    ) -> None:
        """on_end: called once when the session ends (closed, peer gone, timeout, foreign frame)."""
        self.group: dist.ProcessGroup | None = group  # None once the session ended
        self.peer, self.fp, self.device, self._on_end = peer, fp, torch.device(device), on_end
        self._posted: _Posted | None = None
        self._ended: str | None = None  # why it ended
        self.counts = WireCounts()

    def send(self, kind: MsgType, msg=None, timeout: datetime.timedelta | None = None) -> None:
        """Both transfers are posted before waiting (each costs a round trip with the peer). A
        send completes only once the peer posts its receive, so a stalled peer blocks the
        sender: callers that must not hang pass a timeout."""
        header, body = frame(kind, msg, self.fp)
        parts = [t.to(self.device) for t in ([header, body] if body.numel() else [header])]
        self._transfer("send", lambda g: [g.send([t], self.peer, _TAG) for t in parts], timeout)
        self.counts.on_send(kind, body.numel())

    def poll(self) -> bool:
        """Whether the next message has arrived (posts its receive on first call, which a helper
        thread completes: the peer's send of it no longer waits for recv()). True once the
        session has ended: the recv() that follows raises ChannelClosed."""
        if self._posted is None:
            if self.group is None:
                return True
            self._posted = _Posted(self.group, self.peer, self.device, self.fp)
        return self._posted.arrived()

    def recv(self, timeout: datetime.timedelta | None = None) -> tuple[MsgType, object]:
        """-> (kind, message; None for READY and SHUTDOWN)"""
        if self._posted is not None:
            header, body = self._take_posted(timeout)
        else:
            header, body = self._receive(timeout)
        kind, msg = unframe(header.cpu(), body.cpu())
        self.counts.on_receive(kind, body.numel())
        return kind, msg

    def _receive(self, timeout: datetime.timedelta | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The next message's header and body, received on this thread."""
        header = torch.zeros(HEADER, dtype=torch.long, device=self.device)
        self._transfer("receive", lambda g: [g.recv([header], self.peer, _TAG)], timeout)
        try:
            size = body_size(header.cpu(), self.fp)
        except ForeignMessage as err:
            self._abort(f"foreign frame: {err}")
            raise
        body = torch.zeros(size, dtype=torch.uint8, device=self.device)
        if size:
            self._transfer("receive", lambda g: [g.recv([body], self.peer, _TAG)], timeout)
        return header, body

    def close(self, peer_exited: bool = False) -> None:
        if peer_exited:  # its store went with it: freeing its owner key would only fail (and c10d warn)
            self._on_end = None
        self._abort("closed by this end")

    def _live(self) -> dist.ProcessGroup:
        group = self.group
        if group is None:
            raise ChannelClosed(f"channel is closed ({self._ended})")
        return group

    def _take_posted(self, timeout: datetime.timedelta | None) -> tuple[torch.Tensor, torch.Tensor]:
        posted = self._posted
        if not posted.done.wait(None if timeout is None else timeout.total_seconds()):
            self._abort("receive timed out")
            raise ChannelTimeout(f"peer sent nothing within {timeout.total_seconds():g} s")
        self._posted = None
        if isinstance(posted.error, ForeignMessage):
            self._abort(f"foreign frame: {posted.error}")
            raise posted.error
        if posted.error is not None:
            raise self._failed("receive", posted.error) from posted.error
        return posted.header, posted.body

    def _transfer(self, what: str, post, timeout: datetime.timedelta | None) -> None:
        """Post the operations (post(group) -> [Work]) and wait for all of them."""
        group = self._live()
        try:
            for work in post(group):
                if self.device.type == "cuda" and timeout is None:
                    work.wait()  # orders the current stream after the transfer
                    torch.cuda.current_stream(self.device).synchronize()
                else:  # gloo, or NCCL with a deadline: blocks this thread
                    work.wait(GROUP_TIMEOUT if timeout is None else timeout)
        except RuntimeError as err:
            raise self._failed(what, err) from err

    def _failed(self, what: str, err: RuntimeError) -> RuntimeError:
        text = str(err)
        self._abort(f"{what} failed")
        if "Timed out waiting" in text:
            return ChannelTimeout(f"peer did not respond in time while waiting to {what}: {text.split('] ')[-1]}")
        if "pair closure" in text:  # our own abort: close(), or an earlier timeout on this pair
            return ChannelClosed(f"channel was closed while waiting to {what} ({self._ended})")
        return ChannelClosed(f"peer is gone (waiting to {what}): {text.split('] ')[-1].split('. This is')[0][:200]}")

    def _abort(self, reason: str) -> None:
        """End the session for both ends now: closes the pair's sockets, wakes every waiter."""
        group, self.group = self.group, None
        if group is None:
            return
        self._ended = reason
        try:
            if self.device.type == "cuda":
                group.abort()
            else:
                # The 1 ms receive can only time out (or fail at once on a pair already broken).
                group.recv([torch.zeros(1, dtype=torch.uint8)], self.peer, _ABORT_TAG).wait(_ABORT_WAIT)
        except RuntimeError as err:
            logger.debug("pair aborted (%s): %s", reason, err)
        on_end, self._on_end = self._on_end, None  # it may hold the store: let it go
        if on_end is None:
            return
        if reason == "closed by this end":
            _end_quietly(on_end, reason)
        else:
            # After a failure the peer's store may be unreachable (a partition): its call would
            # block this end (the target's round) until the link came back, so it runs aside.
            threading.Thread(target=_end_quietly, args=(on_end, reason), name="ssd-channel-end", daemon=True).start()


def _end_quietly(on_end: Callable[[], None], reason: str) -> None:
    try:
        on_end()
    except RuntimeError as err:  # e.g. the worker's store is gone with the worker
        logger.debug("on_end after %s: %s", reason, err)


def parse_torch_address(address: str) -> tuple[str, int]:
    """'torch://HOST:PORT' -> (host, port); ValueError naming the expected form otherwise."""
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"bad torch transport address {address!r}: expected 'torch://HOST:PORT'") from err
    if parts.scheme != "torch" or not host or not port or parts.path or parts.query or parts.username:
        raise ValueError(f"bad torch transport address {address!r}: expected 'torch://HOST:PORT'")
    return host, port


class TorchListener:
    """The worker's end (the `Listener` protocol): a TCPStore server on a port the OS picked.
    host: the address targets reach this worker at (its gloo sockets bind to it too)."""

    def __init__(self, host: str = "127.0.0.1", device: torch.device | str = "cpu") -> None:
        self.host, self.device = host, torch.device(device)
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=HANDSHAKE_TIMEOUT)
        store.set(_BACKEND, backend_for(self.device))
        store.set(_OWNER, _FREE)
        self._store: dist.TCPStore | None = store
        self.address = f"torch://[{host}]:{store.port}" if ":" in host else f"torch://{host}:{store.port}"
        self._session: TorchChannel | None = None

    def accept(self, fp: int, timeout: datetime.timedelta | None = None) -> TorchChannel:
        """Ends the previous session (closes its channel), then waits for the next target's."""
        store = self._store
        if store is None:
            raise ChannelClosed(f"listener {self.address} is closed")
        if self._session is not None:
            self._session.close()
            self._session = None
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while True:
            owner = store.get(_OWNER).decode()
            if owner != _FREE:
                try:
                    group = new_pair_group(dist.PrefixStore(f"session/{owner}/", store), 1, self.device, self.host)
                except RuntimeError as err:  # the target died or gave up after claiming
                    logger.warning("target of session %s on %s did not join: %s", owner, self.address, err)
                    store.compare_set(_OWNER, owner, _FREE)
                    continue
                # Either end noticing the end of the session frees the worker for the next one.
                channel = TorchChannel(group, 0, fp, self.device, on_end=_freer(store, owner))
                self._session = channel
                logger.info("session %s open on %s", owner, self.address)
                return channel
            if deadline is not None and time.monotonic() >= deadline:
                raise ChannelTimeout(f"no target connected to {self.address} within {timeout.total_seconds():g} s")
            time.sleep(_POLL_S)

    def close(self) -> None:
        """Ends the open session, if any, and stops the store server (with the last reference to
        it: the session's group holds one until its channel is closed)."""
        if self._session is not None:
            self._session.close()
            self._session = None
        self._store = None


def _freer(store: dist.Store, session: str) -> Callable[[], None]:
    """Frees the worker's owner key if `session` still holds it (a no-op once the other end has)."""
    return lambda: store.compare_set(_OWNER, session, _FREE)


def connect_torch(
    address: str, fp: int, timeout: datetime.timedelta, device: torch.device | str = "cpu"
) -> TorchChannel:
    """The target's end: a session with the worker listening at `address` ('torch://HOST:PORT').
    ValueError: malformed address. ChannelClosed: nothing listens there. ChannelTimeout: no
    answer, or the worker did not join, within `timeout`. WorkerBusy: it serves another target."""
    host, port = parse_torch_address(address)
    device = torch.device(device)
    mine = backend_for(device)
    deadline = time.monotonic() + timeout.total_seconds()

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(0.1, deadline - time.monotonic()))

    # A plain connection first: fails fast when nothing listens (the store client would retry
    # for up to twice its timeout), and names the local address that routes to the worker.
    # A worker that is going away accepts and then resets connections: that is ChannelClosed, at
    # the probe (ConnectionResetError, an OSError) as at the store ("Connection reset by peer").
    try:
        with socket.create_connection((host, port), timeout=timeout.total_seconds()) as probe:
            local = probe.getsockname()[0]
    except TimeoutError as err:
        raise ChannelTimeout(f"draft worker at {address} did not answer within {timeout.total_seconds():g} s") from err
    except OSError as err:
        raise ChannelClosed(f"no draft worker listens at {address}: {err}") from err
    store_timeout = min(left(), STORE_CONNECT_TIMEOUT)
    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=store_timeout)
        theirs = store.get(_BACKEND).decode()
    except (RuntimeError, OSError) as err:
        # The store client retries reset connections until its timeout; whether it then reports
        # the last reset or the time out depends on where its retry loop stands. Either way, a
        # port that took the probe but whose store never connected within STORE_CONNECT_TIMEOUT
        # (not the caller's shorter deadline) is a worker going away.
        never_connected = "trying to connect" in str(err) and store_timeout >= STORE_CONNECT_TIMEOUT
        if isinstance(err, OSError) or "reset by peer" in str(err) or never_connected:
            raise ChannelClosed(
                f"the draft worker at {address} reset the connection (it is going away): {err}"
            ) from err
        raise ChannelTimeout(
            f"draft worker at {address} did not answer within {timeout.total_seconds():g} s: {err}"
        ) from err
    if theirs != mine:
        raise RuntimeError(f"draft worker at {address} uses {theirs}; this target's device {device} needs {mine}")
    session = str(store.add(_SESSIONS, 1))
    owner = store.compare_set(_OWNER, _FREE, session).decode()
    if owner != session:
        raise WorkerBusy(
            f"draft worker at {address} is busy with another target (session {owner}); it serves one at a time"
        )
    try:
        store.set_timeout(left())
        group = new_pair_group(dist.PrefixStore(f"session/{session}/", store), 0, device, local, left())
    except RuntimeError as err:
        store.compare_set(_OWNER, session, _FREE)
        raise ChannelTimeout(
            f"draft worker at {address} did not join within {timeout.total_seconds():g} s: {err}"
        ) from err
    logger.info("session %s with the draft worker at %s", session, address)
    return TorchChannel(group, 1, fp, device, on_end=_freer(store, session))
